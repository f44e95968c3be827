"""Reading a dataset where the preprocessing put it: a local (or shared) directory, or an object store.

A *location* is a local path or a URL: ``s3://bucket/key`` goes through boto3 (installed with the
``aws`` extra; credentials and endpoint from its usual chain: ``AWS_*`` variables, ``~/.aws``, an
instance role; ``AWS_ENDPOINT_URL`` for an S3-compatible store), any other scheme through fsspec
(``gs://`` with gcsfs, ``https://``, ...). Nothing here reads credentials from a config file.

Objects are read whole (a shard is tens of MB) and each read is retried with exponential backoff: a
store that errors or stalls (a read timeout) is retried ``attempts`` times, and then a
:class:`StoreError` names the URL. A missing object, and a refusal (credentials, permissions), are not
retried. The start of a run checks that every shard exists with its size by :func:`sizes`, a listing, not a
read.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 60  # a stalled read fails after this long, and is retried
T = TypeVar("T")


class StoreError(OSError):
    """An object that stayed unreadable (its URL in the message)."""


def is_url(location: str | Path) -> bool:
    """Whether ``location`` names an object store (``scheme://``) rather than a local path."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


def join(root: str | Path, *parts: str) -> str:
    """``root/part/...`` for a URL or a local path."""
    if is_url(root):
        return "/".join([str(root).rstrip("/"), *(p.strip("/") for p in parts)])
    return str(Path(str(root).removeprefix("file://"), *parts))


CLIENTS: dict[int, Any] = {}  # process id -> its S3 client


def s3_client() -> Any:  # a botocore S3 client
    """This process's S3 client. One per process: a DataLoader worker forked from a rank must not share the
    rank's open connections (two processes reading one socket get each other's bytes)."""
    client = CLIENTS.get(os.getpid())
    if client is None:
        import boto3
        from botocore.config import Config

        config = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S, retries={"max_attempts": 1})
        client = CLIENTS[os.getpid()] = boto3.client("s3", config=config)
    return client


def read_once(location: str) -> bytes:
    """The whole object or file, one attempt; FileNotFoundError when it does not exist."""
    if not is_url(location):
        return Path(location.removeprefix("file://")).read_bytes()
    if location.startswith("s3://"):
        bucket, _, key = location.removeprefix("s3://").partition("/")
        client = s3_client()
        try:
            return client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except client.exceptions.NoSuchKey:
            raise FileNotFoundError(location) from None
    import fsspec

    with fsspec.open(location, "rb") as f:
        return f.read()


def read_bytes(location: str, *, attempts: int = 5, retry_max_s: float = 30.0) -> bytes:
    """``location``'s bytes, retrying a failed read with backoff (1 s doubling to ``retry_max_s``)."""
    return retrying(lambda: read_once(location), location, attempts=attempts, retry_max_s=retry_max_s)


def retrying(call: Callable[[], T], location: str, *, attempts: int = 5, retry_max_s: float = 30.0) -> T:
    """``call()``, retried with backoff (1 s doubling to ``retry_max_s``) while ``location``'s store errs or
    stalls; a missing object (FileNotFoundError) and a refusal are not retried."""
    wait = 1.0
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except FileNotFoundError:
            raise
        except Exception as err:  # connection refused, timeouts, 5xx: the store's trouble, perhaps passing
            if refused(err):
                raise StoreError(f"{location}: {err}") from err
            if attempt == attempts:
                raise StoreError(f"{location}: unreadable after {attempts} attempts: {err}") from err
            log.warning("reading %s failed (%s); attempt %d/%d, retry in %.0fs", location, err, attempt, attempts, wait)
            time.sleep(wait)
            wait = min(wait * 2, retry_max_s)
    raise AssertionError("unreachable")


def sizes(locations: list[str]) -> dict[str, int | None]:
    """Each location's size in bytes, None where it does not exist, without reading any: a ``stat`` of a local
    file, one listing per directory of an S3 bucket (a few requests for thousands of objects), fsspec's
    ``info`` for other schemes. The start of a run checks its shards with it (``runtime.data``)."""
    found: dict[str, int | None] = {}
    listed: dict[str, dict[str, int] | None] = {}  # s3://bucket/prefix/ -> {object URL: size}, None: not listable
    for location in locations:
        if not is_url(location):
            try:
                found[location] = Path(location.removeprefix("file://")).stat().st_size
            except (FileNotFoundError, NotADirectoryError):
                found[location] = None
        elif location.startswith("s3://"):
            prefix = location.rsplit("/", 1)[0] + "/"
            if prefix not in listed:
                try:
                    listed[prefix] = retrying(lambda prefix=prefix: list_s3(prefix), prefix)
                except StoreError as err:
                    if not refused(err.__cause__):  # a store that stayed away
                        raise
                    listed[prefix] = None  # no permission to list (s3:ListBucket): a stat (HEAD) of each object
            entries = listed[prefix]
            found[location] = (
                entries.get(location) if entries is not None else retrying(lambda loc=location: head_s3(loc), location)
            )
        else:
            import fsspec

            fs, path = fsspec.core.url_to_fs(location)
            try:
                found[location] = int(retrying(lambda fs=fs, path=path: fs.info(path), location)["size"])
            except FileNotFoundError:
                found[location] = None
    return found


def head_s3(location: str) -> int | None:
    """The size of the object at ``location`` (``s3://bucket/key``), None when there is none."""
    bucket, _, key = location.removeprefix("s3://").partition("/")
    try:
        return int(s3_client().head_object(Bucket=bucket, Key=key)["ContentLength"])
    except Exception as err:
        if getattr(err, "response", {}).get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def list_s3(prefix: str) -> dict[str, int]:
    """``{s3://bucket/key: size}`` of every object under ``prefix`` (``s3://bucket/dir/``), page by page."""
    bucket, _, key_prefix = prefix.removeprefix("s3://").partition("/")
    pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key_prefix)
    return {f"s3://{bucket}/{obj['Key']}": int(obj["Size"]) for page in pages for obj in page.get("Contents", [])}


def refused(err: BaseException | None) -> bool:
    """A 4xx answer other than throttling: retrying cannot help (credentials, permissions, no such bucket)."""
    response = getattr(err, "response", None)
    if not isinstance(response, dict):
        return False
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return 400 <= status < 500 and status != 429 and response.get("Error", {}).get("Code") != "SlowDown"
