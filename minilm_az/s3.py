"""S3 as a checkpoint store: `s3://BUCKET/PREFIX` through AWS's s3torchconnector (the `s3` extra).

Where and who follow the AWS conventions, so that one command works on SageMaker, on a laptop and against
MinIO or a local test server: the endpoint is AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL, else AWS's own; the
region is AWS_REGION, else AWS_DEFAULT_REGION; the credentials come from the usual chain (environment, profile,
the instance's or the job's role); the attempts of a request from AWS_MAX_ATTEMPTS. `Store` holds one client and
does the few things the checkpointer needs besides DCP's own writer and reader: put, get, list and delete small
objects, and a write probe at start.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass

EXTRA = "pip install 'minilm-az[s3]' (s3torchconnector)"


class S3Error(ValueError):
    """An S3 location that cannot be used: the message names the URI and the reason, in one line."""


def is_s3(path: str | None) -> bool:
    """Whether `path` is an s3:// prefix. A URL of another form (S3://, s3a://, s3:/x) is refused, never taken for
    a local directory named `S3:` that a job's hosts would each fill on their own disks."""
    if path and not path.startswith("s3://") and re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:/|s3:", path, re.IGNORECASE):
        raise S3Error(f"--checkpoint-dir {path}: a URL, but not s3://BUCKET/PREFIX (lower-case s3, two slashes)")
    return bool(path) and path.startswith("s3://")


@dataclass(frozen=True)
class Location:
    """A bucket and a key prefix (no leading or trailing slash; may be empty)."""

    bucket: str
    prefix: str

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def uri(self, *parts: str) -> str:
        return f"s3://{self.bucket}/{self.key(*parts)}"


def parse(uri: str) -> Location:
    """`s3://bucket/some/prefix/` -> Location; a URI without a bucket is refused."""
    rest = uri.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    if not bucket or "//" in rest:  # an empty segment is a key of its own on S3: "a//b" and "a/b" are two prefixes
        raise S3Error(f"{uri}: not an S3 prefix of the form s3://BUCKET/PREFIX")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        raise S3Error(f"{uri}: {bucket!r} is not an S3 bucket name (3-63 lower-case letters, digits, dots, hyphens)")
    return Location(bucket, prefix.strip("/"))


def _reason(e: BaseException) -> str:
    """The client's error in one line: S3's own error code and message where the response has them (the native
    client's text puts them after its internals), else the start of its text."""
    text = " ".join(str(e).split())
    if "No signing credentials" in text:
        return "no AWS credentials found (environment, ~/.aws, or the job's or instance's role)"
    code, message = re.search(r"<Code>(.*?)</Code>", text), re.search(r"<Message>(.*?)</Message>", text)
    status = re.search(r"response_status: (\d+)", text)
    if code:
        return f"{status.group(1) + ' ' if status else ''}{code.group(1)}{': ' + message.group(1) if message else ''}"
    return f"{type(e).__name__}: {text}"[:300]


class Store:
    """One S3 client for a checkpoint prefix: endpoint, region and credentials from the AWS environment."""

    def __init__(self, uri: str):
        try:
            from s3torchconnector import S3ClientConfig
            from s3torchconnector._s3client import S3Client
        except ImportError:
            raise S3Error(f"{uri}: checkpoints on S3 need s3torchconnector: {EXTRA}") from None
        self.uri = uri.rstrip("/")
        self.where = parse(uri)
        self.region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if not self.region:
            raise S3Error(f"{uri}: no AWS region: set AWS_REGION (or AWS_DEFAULT_REGION) to the bucket's region")
        self.endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        # A custom endpoint (MinIO, a local server) names buckets in the path, not in the host name. The client
        # retries a throttled or failed request (503 SlowDown, 500, a reset connection) up to AWS_MAX_ATTEMPTS
        # times in all, with backoff, as AWS's SDKs do; 10 when unset.
        attempts = os.environ.get("AWS_MAX_ATTEMPTS", "10")
        if not attempts.isdigit() or not 1 <= int(attempts) <= 100:
            raise S3Error(f"AWS_MAX_ATTEMPTS={attempts}: not a whole number of attempts from 1 to 100")
        self.config = S3ClientConfig(force_path_style=self.endpoint is not None, max_attempts=int(attempts))
        self.client = S3Client(self.region, endpoint=self.endpoint, s3client_config=self.config)

    def put(self, key: str, data: bytes) -> None:
        """One PUT: the object appears whole when the call returns, or not at all."""
        stream = self.client.put_object(self.where.bucket, key)
        try:
            stream.write(data)
        except BaseException:
            with contextlib.suppress(Exception):  # closed now: left to the exit, the native client panics
                stream.close()
            raise
        stream.close()

    def get(self, key: str) -> bytes:
        return self.client.get_object(self.where.bucket, key).read()

    def delete(self, key: str) -> None:
        self.client.delete_object(self.where.bucket, key)

    def list(self, prefix: str) -> dict[str, tuple[int, str]]:
        """Every object under `prefix` (a key prefix, ending with '/' for a folder): key -> (size, ETag). The ETag
        changes whenever an object is written again, even with as many bytes."""
        found = {}
        for page in self.client.list_objects(self.where.bucket, prefix):
            for info in page.object_info:
                found[info.key] = (info.size, info.etag)
        return found

    def probe(self, name: str) -> None:
        """Put, list, read back and delete a small object under the prefix: a missing bucket, a denied request or no
        credentials show here, in one line, before training starts."""
        key = self.where.key(f".minilm-az-probe-{name}")
        step = "LIST"  # first: without credentials a LIST says so, a PUT only that its request ended
        try:
            self.list(key)
            step = "PUT"
            self.put(key, b"probe")
            step = "LIST"
            listed = self.list(key)
            step = "GET"
            if self.get(key) != b"probe" or key not in listed:
                raise S3Error("the probe object did not read back")
            step = "DELETE"
            self.delete(key)
        except Exception as e:  # the native client's S3Exception, or an error of the credentials chain
            where = f" (endpoint {self.endpoint})" if self.endpoint else ""
            raise S3Error(
                f"--checkpoint-dir {self.uri}: cannot {step} s3://{self.where.bucket}/{key}{where}, region "
                f"{self.region}: {_reason(e)}; the job's credentials need s3:GetObject, s3:PutObject, s3:ListBucket "
                f"and s3:DeleteObject on this prefix"
            ) from None

    def writer(self, path: str, **kwargs):
        """DCP's S3 writer for checkpoint `path` (an s3:// URI), sharing this store's client."""
        from s3torchconnector.dcp import S3StorageWriter
        from s3torchconnector.dcp.s3_file_system import S3FileSystem

        writer = S3StorageWriter(self.region, path, s3client_config=self.config, **kwargs)
        writer.fs = S3FileSystem(self.region, s3_client=self.client)  # the client with this store's endpoint
        writer.path = writer.fs.init_path(path)
        return writer

    def reader_class(self):
        """DCP's S3 reader class, bound to this store's client (checkpoint.py subclasses it)."""
        from s3torchconnector.dcp import S3StorageReader
        from s3torchconnector.dcp.s3_file_system import S3FileSystem

        store = self

        class Reader(S3StorageReader):
            def __init__(self, path: str):
                super().__init__(store.region, path, s3client_config=store.config)
                reads = self._reader_constructor
                self.fs = S3FileSystem(store.region, s3_client=store.client, reader_constructor=reads)
                self.path = self.fs.init_path(path)

        return Reader
