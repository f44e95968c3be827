"""Reading a dataset where the preprocessing put it: a local (or shared) directory, or an object store.

A *location* is a local path or a URL: ``s3://bucket/key`` goes through boto3 (installed with the
``aws`` extra; credentials and endpoint from its usual chain: ``AWS_*`` variables, ``~/.aws``, an
instance role; ``AWS_ENDPOINT_URL`` for an S3-compatible store), any other scheme through fsspec
(``gs://`` with gcsfs, ``https://``, ...). Nothing here reads credentials from a config file.

Objects are read whole (a shard is tens of MB) and each read is retried with exponential backoff: a
store that errors or stalls (a read timeout) is retried ``attempts`` times, and then a
:class:`StoreError` names the URL. A missing object, and a refusal (credentials, permissions), are not
retried.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 60  # a stalled read fails after this long, and is retried


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
    wait = 1.0
    for attempt in range(1, attempts + 1):
        try:
            return read_once(location)
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


def refused(err: Exception) -> bool:
    """A 4xx answer other than throttling: retrying cannot help (credentials, permissions, no such bucket)."""
    response = getattr(err, "response", None)
    if not isinstance(response, dict):
        return False
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return 400 <= status < 500 and status != 429 and response.get("Error", {}).get("Code") != "SlowDown"
