"""A local S3 server for the tests (moto's, on loopback), with faults the test injects from the server side.

    server = S3Server.start(tmp_path)          # a subprocess: `python s3_server.py PORT FAULTS_FILE`
    server.env()                               # AWS_ENDPOINT_URL_S3, AWS_REGION and test credentials
    server.make_bucket("ckpt")
    server.faults(put_status=503, put_share=0.3, match=r"\\.distcp$")  # a share of PUTs answered 503
    server.faults()                            # no faults again
    server.keys("ckpt", "run/")                # what S3 holds, read with boto3

Faults apply to PUT requests (single PUTs and the parts of multipart uploads) whose path matches `match`:
`put_status` answers `put_share` of them with that status and S3's XML error body; `put_delay_s` holds each one
that long first; `reset_share` closes the connection without an answer (a TCP reset) instead; with `once` a
fault hits only the first try of each request, so every retry passes (a test that must not depend on luck). They
are read from a JSON file at each request, so a test changes them while a job runs, without restarting the server.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, proc: subprocess.Popen, port: int, faults_file: Path):
        self.proc, self.port, self.faults_file = proc, port, faults_file
        self.url = f"http://127.0.0.1:{port}"

    @classmethod
    def start(cls, workdir: Path) -> S3Server:
        workdir.mkdir(parents=True, exist_ok=True)
        faults_file = workdir / "faults.json"
        faults_file.write_text("{}")
        port = free_port()
        env = {**os.environ, **_credentials()}
        proc = subprocess.Popen(
            [sys.executable, __file__, str(port), str(faults_file)],
            env=env,
            stdout=open(workdir / "server.log", "w"),
            stderr=subprocess.STDOUT,
        )
        server = cls(proc, port, faults_file)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return server
            except OSError:
                if proc.poll() is not None:
                    log = (workdir / "server.log").read_text()
                    raise RuntimeError(f"s3_server exited {proc.returncode}: {log}") from None
                time.sleep(0.1)
        proc.kill()
        raise RuntimeError("s3_server did not start in 60 s")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def env(self) -> dict[str, str]:
        """What a process needs to talk to this server as it would to AWS."""
        return {**_credentials(), "AWS_ENDPOINT_URL_S3": self.url, "AWS_REGION": REGION}

    def faults(self, **faults) -> None:
        tmp = self.faults_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(faults))
        os.replace(tmp, self.faults_file)

    def boto(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def make_bucket(self, bucket: str) -> None:
        self.boto().create_bucket(Bucket=bucket)

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """key -> size of every object under prefix."""
        found, client = {}, self.boto()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            found.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        return found

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        return sorted(self.objects(bucket, prefix))


def _credentials() -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    }


# ---------------------------------------------------------------------------------------------
# The server process


def _with_faults(app, faults_file: str):
    """moto's WSGI app behind the faults of `faults_file` (re-read when it changes)."""
    state = {"mtime": None, "faults": {}}
    tried: set[str] = set()  # requests a `once` fault has hit: their retries pass

    def current() -> dict:
        mtime = os.stat(faults_file).st_mtime_ns
        if mtime != state["mtime"]:
            state["mtime"], state["faults"] = mtime, json.loads(open(faults_file).read() or "{}")
        return state["faults"]

    def wrapped(environ, start_response):
        faults = current()
        path = environ.get("PATH_INFO", "")
        if environ["REQUEST_METHOD"] == "PUT" and faults and re.search(faults.get("match", ""), path):
            time.sleep(float(faults.get("put_delay_s", 0)))
            request = f"{path}?{environ.get('QUERY_STRING', '')}"
            if faults.get("once"):  # the first try of each request (an object, a part) fails, its retry passes
                if request in tried:
                    return app(environ, start_response)
                tried.add(request)
            length = environ.get("CONTENT_LENGTH")
            if random.random() < float(faults.get("reset_share", 0)):
                sock = environ.get("werkzeug.socket")
                if sock is not None:  # SO_LINGER 0: close() sends a reset, not a FIN
                    if length:  # once the body is in: the client then sees the reset at once, not a timeout
                        environ["wsgi.input"].read(int(length))
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.close()
                    return []
            if random.random() < float(faults.get("put_share", 0)):
                status = int(faults.get("put_status", 503))
                code = {403: "AccessDenied", 500: "InternalError", 503: "SlowDown"}.get(status, "InternalError")
                body = f"<Error><Code>{code}</Code><Message>injected by s3_server</Message></Error>".encode()
                headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))]
                # Read the body the request declares, so that the client reads the answer at once (an unbounded
                # read waited ~32 s for more); one of unknown length is not read, and the connection closes.
                if length:
                    environ["wsgi.input"].read(int(length))
                else:
                    headers.append(("Connection", "close"))
                start_response(f"{status} Injected", headers)
                return [body]
        return app(environ, start_response)

    return wrapped


def main(port: int, faults_file: str) -> None:
    from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    app = _with_faults(DomainDispatcherApplication(create_backend_app), faults_file)
    server = make_server("127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler)
    print(f"s3_server on 127.0.0.1:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
