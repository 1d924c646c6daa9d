"""Real S3 servers on loopback for the object-store tests: moto's server and
versitygw (posix backend), each with one bucket made for the test.

    with start_versitygw(tmp_path / "vgw") as s3:      # or start_moto(...)
        s3.endpoint, s3.bucket, s3.access_key, s3.secret_key, s3.region
        s3.write_credentials(tmp_path / "creds")     # AWS_ACCESS_KEY_ID=... (mode 0600)
        c = s3.client()                              # boto3, path-style, to tamper
        s3.kill(); s3.restart()                      # versitygw only: same port, same data

or the pytest fixtures `moto_server`, `versitygw_server` and `s3_server`
(parametrized over both), imported into a test module:

    sys.path.insert(0, str(HELPERS))
    from s3servers import s3_server, moto_server, versitygw_server  # noqa: F401

A server that is not installed skips the test, naming what is missing and how
scripts/test.sh installs it (scripts/lib.sh: install_object_store_test_deps).

moto keeps its state in memory: kill() loses every object, and restart() is
refused (RuntimeError); tests that kill the server mid-upload and restart it
use versitygw, whose objects are files under its root directory (metadata,
ETags included, in user xattrs, or in a sidecar directory where the
filesystem has none).

Signatures: versitygw always checks them (root account --access/--secret).
moto checks none by default, and that is start_moto's default too:
`S3Server.verifies_signatures` says which. start_moto(verify_signatures=True)
turns moto's IAM authentication on (an IAM user with an allow-all policy is
made while it is off, then /moto-api/reset-auth; the access key and secret are
then moto-generated), but moto 5.2 recomputes the signature over the decoded
URL, so every request whose path or query holds a character SigV4
percent-encodes other than space (`[ ] = : + , @ % ! ( ) * ' $ ; &`, and `/`
in a query value such as ListObjectsV2's prefix=a/b) is refused with
SignatureDoesNotMatch: only for tests whose keys and prefixes avoid those.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REGION = "us-east-1"
DEFAULT_BUCKET = "bulwark-test"
VERSITYGW_VERSION = "v1.8.0"
START_TIMEOUT_S = 30
STOP_TIMEOUT_S = 10
LOG_TAIL_CHARS = 4000


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _require_boto3():
    try:
        import boto3  # noqa: F401
        import botocore  # noqa: F401
    except ImportError:
        pytest.skip(f"boto3 is not installed for {sys.executable} "
                    f"(scripts/test.sh installs moto[server], which brings it)")


def find_versitygw() -> str | None:
    """$VERSITYGW, versitygw on PATH, or in $GOBIN, $GOPATH/bin, ~/go/bin."""
    env = os.environ.get("VERSITYGW")
    if env:
        return env if os.access(env, os.X_OK) else None
    on_path = shutil.which("versitygw")
    if on_path:
        return on_path
    dirs = [os.environ.get("GOBIN")]
    dirs += [os.path.join(p, "bin") for p in os.environ.get("GOPATH", "").split(os.pathsep) if p]
    dirs.append(os.path.expanduser("~/go/bin"))
    for d in dirs:
        if d and os.access(os.path.join(d, "versitygw"), os.X_OK):
            return os.path.join(d, "versitygw")
    return None


def versitygw_version(binary: str) -> str | None:
    """The module version `go install` recorded in the binary's build info
    (`versitygw --version` says only "git" for such builds)."""
    try:
        data = Path(binary).read_bytes()
    except OSError:
        return None
    marker = b"mod\tgithub.com/versity/versitygw\t"
    i = data.find(marker)
    if i < 0:
        return None
    end = data.find(b"\t", i + len(marker))
    return data[i + len(marker):end].decode(errors="replace") if end > 0 else None


# loopback only: never through an http_proxy from the environment
_URLOPEN = urllib.request.build_opener(urllib.request.ProxyHandler({})).open


def _wait_http(url: str, proc: subprocess.Popen, log: Path, what: str,
               timeout: float = START_TIMEOUT_S) -> None:
    """Poll `url` until the server answers anything HTTP (a readiness probe,
    bounded by `timeout`); fail with the server's log if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} while starting:\n"
                               f"{_tail(log)}")
        try:
            with _URLOPEN(url, timeout=2) as r:
                r.read()
            return
        except urllib.error.HTTPError:
            return  # it answered (403/404...): it is up
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{what} did not answer at {url} within {timeout}s:\n{_tail(log)}")
        time.sleep(0.05)


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return "(no log)"


class S3Server:
    """A running S3 server with one bucket. Attributes: kind ("moto" or
    "versitygw"), endpoint ("http://127.0.0.1:PORT"), host, port, bucket,
    access_key, secret_key, region, workdir, log (path of its output),
    version."""

    kind = "s3"

    def __init__(self, workdir: Path, *, bucket: str, port: int | None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.bucket = bucket
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.region = REGION
        self.access_key = ""
        self.secret_key = ""
        self.version = None
        self.verifies_signatures = True
        self.log = self.workdir / f"{self.kind}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- for tests

    def env(self) -> dict[str, str]:
        """The AWS_* environment variables that name these credentials."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_REGION": self.region}

    def write_credentials(self, path: Path) -> Path:
        """A credentials file, mode 0600: AWS_ACCESS_KEY_ID=...,
        AWS_SECRET_ACCESS_KEY=..., AWS_REGION=us-east-1, one a line."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{k}={v}\n" for k, v in self.env().items()))
        os.chmod(path, 0o600)
        return path

    def client(self, endpoint: str | None = None, *, attempts: int = 1, timeout: float = 30,
               secret_key: str | None = None, **config):
        """A boto3 S3 client for this server (or for `endpoint`, e.g. a
        FaultProxy's), path-style, `attempts` tries in all (default 1: no
        retries, so a test sees every failure), checksums only where an
        operation requires them, no $http_proxy. Extra keyword arguments go to
        botocore.config.Config."""
        _require_boto3()
        import boto3
        from botocore.config import Config
        cfg = dict(s3={"addressing_style": "path"},
                   retries={"total_max_attempts": attempts, "mode": "standard"},
                   connect_timeout=timeout, read_timeout=timeout,
                   request_checksum_calculation="when_required",
                   response_checksum_validation="when_required",
                   proxies={})  # loopback: never through $http_proxy
        cfg.update(config)
        return boto3.client("s3", endpoint_url=endpoint or self.endpoint,
                            aws_access_key_id=self.access_key,
                            aws_secret_access_key=secret_key or self.secret_key,
                            region_name=self.region, config=Config(**cfg))

    def keys(self, prefix: str = "") -> list[str]:
        """Every key in the bucket under `prefix`, sorted."""
        c = self.client()
        # moto checking signatures refuses an encoded prefix: filter here
        server_side = not (self.kind == "moto" and self.verifies_signatures)
        out = []
        pages = c.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, **({"Prefix": prefix} if server_side else {}))
        for page in pages:
            out += [o["Key"] for o in page.get("Contents", []) if o["Key"].startswith(prefix)]
        return sorted(out)

    def log_tail(self) -> str:
        return _tail(self.log)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- lifecycle

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        return dict(os.environ)

    def _spawn(self) -> None:
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(self._argv(), stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self._env(),
                                         cwd=self.workdir, start_new_session=True)

    def _ready_url(self) -> str:
        return self.endpoint + "/"

    def _wait_ready(self) -> None:
        _wait_http(self._ready_url(), self.proc, self.log, f"{self.kind} on {self.endpoint}")

    def start(self) -> "S3Server":
        self._spawn()
        try:
            self._wait_ready()
            self._setup()
        except BaseException:
            self.kill()
            raise
        return self

    def _setup(self) -> None:
        self.client().create_bucket(Bucket=self.bucket)

    def kill(self) -> None:
        """SIGKILL the server and wait for it."""
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> "S3Server":
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def __repr__(self):
        return f"<{self.kind} {self.version or ''} {self.endpoint} bucket={self.bucket}>"


class MotoServer(S3Server):
    kind = "moto"

    def __init__(self, workdir, *, bucket=DEFAULT_BUCKET, port=None, verify_signatures=False):
        super().__init__(workdir, bucket=bucket, port=port)
        self.verifies_signatures = verify_signatures
        import importlib.metadata
        try:
            self.version = importlib.metadata.version("moto")
        except importlib.metadata.PackageNotFoundError:
            self.version = None
        self.access_key = "bulwark-test"
        self.secret_key = secrets.token_hex(16)

    def _argv(self):
        return [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)]

    def _env(self):
        env = dict(os.environ)
        env.pop("INITIAL_NO_AUTH_ACTION_COUNT", None)
        env.setdefault("MOTO_ALLOW_NONEXISTENT_REGION", "true")
        return env

    def _ready_url(self):
        return self.endpoint + "/moto-api/data.json"

    def _setup(self):
        _require_boto3()
        if self.verifies_signatures:
            import boto3
            from botocore.config import Config
            iam = boto3.client("iam", endpoint_url=self.endpoint, region_name=self.region,
                               aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap",
                               config=Config(proxies={}))
            iam.create_user(UserName="bulwark")
            iam.put_user_policy(UserName="bulwark", PolicyName="all", PolicyDocument=json.dumps({
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
            key = iam.create_access_key(UserName="bulwark")["AccessKey"]
            self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]
            req = urllib.request.Request(self.endpoint + "/moto-api/reset-auth", data=b"0",
                                         method="POST", headers={"Content-Type": "text/plain"})
            with _URLOPEN(req, timeout=10) as r:
                r.read()
        super()._setup()

    def restart(self):
        raise RuntimeError("moto keeps its objects in memory: a restarted moto would be empty; "
                           "use versitygw for kill-and-restart tests")


class VersityGW(S3Server):
    kind = "versitygw"

    def __init__(self, workdir, *, bucket=DEFAULT_BUCKET, port=None, keep_alive=True,
                 binary: str | None = None):
        super().__init__(workdir, bucket=bucket, port=port)
        self.binary = binary or find_versitygw()
        self.version = versitygw_version(self.binary) if self.binary else None
        self.root = self.workdir / "root"
        self.root.mkdir(exist_ok=True)
        self.sidecar = None
        if not _has_user_xattrs(self.root):
            self.sidecar = self.workdir / "meta"
            self.sidecar.mkdir(exist_ok=True)
        self.keep_alive = keep_alive
        self.access_key = "bulwark-test"
        self.secret_key = secrets.token_hex(16)

    def _argv(self):
        argv = [self.binary, "--access", self.access_key, "--secret", self.secret_key,
                "--region", self.region, "--port", f"{self.host}:{self.port}", "--quiet"]
        if self.keep_alive:
            argv.append("--keep-alive")
        argv += ["posix"]
        if self.sidecar is not None:
            argv += ["--sidecar", str(self.sidecar)]
        return argv + [str(self.root)]

    def _env(self):
        env = dict(os.environ)
        for k in list(env):  # its flags come only from argv
            if k.startswith("VGW_") or k.startswith("ROOT_ACCESS") or k.startswith("ROOT_SECRET"):
                del env[k]
        return env

    def restart(self) -> "VersityGW":
        """Start it again (after kill() or stop()) on the same port and root
        directory; the bucket and its objects are still there."""
        if self.alive:
            raise RuntimeError("versitygw is still running: kill() or stop() it first")
        self._spawn()
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        return self


def _has_user_xattrs(path: Path) -> bool:
    try:
        os.setxattr(path, "user.bulwark.probe", b"1")
        os.removexattr(path, "user.bulwark.probe")
        return True
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            return False
        raise


def moto_missing() -> str | None:
    """Why moto's server cannot run here, or None."""
    try:
        import moto.server  # noqa: F401
        import flask  # noqa: F401
        import boto3  # noqa: F401
    except ImportError as e:
        return (f"moto[server] is not installed for {sys.executable} ({e}); "
                f"scripts/test.sh installs it with pip")
    return None


def versitygw_missing() -> str | None:
    """Why versitygw cannot run here, or None."""
    if find_versitygw() is None:
        return (f"versitygw not found (PATH, $GOBIN, $GOPATH/bin, ~/go/bin): scripts/test.sh "
                f"installs it with `go install github.com/versity/versitygw/cmd/versitygw@"
                f"{VERSITYGW_VERSION}`, which needs Go >= 1.21 (Debian bookworm's golang-go "
                f"is 1.19)")
    return None


@contextlib.contextmanager
def start_moto(workdir: Path, *, bucket: str = DEFAULT_BUCKET, port: int | None = None,
               verify_signatures: bool = False):
    """moto's server on 127.0.0.1 with `bucket`; skips the test if moto is
    missing. verify_signatures: see the module's docstring (limits on keys)."""
    why = moto_missing()
    if why:
        pytest.skip(why)
    s = MotoServer(workdir, bucket=bucket, port=port, verify_signatures=verify_signatures)
    s.start()
    try:
        yield s
    finally:
        s.stop()


@contextlib.contextmanager
def start_versitygw(workdir: Path, *, bucket: str = DEFAULT_BUCKET, port: int | None = None,
                    keep_alive: bool = True):
    """versitygw (posix backend, root under `workdir`) on 127.0.0.1 with
    `bucket`; skips the test if versitygw or boto3 is missing."""
    why = versitygw_missing()
    if why:
        pytest.skip(why)
    _require_boto3()
    s = VersityGW(workdir, bucket=bucket, port=port, keep_alive=keep_alive)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def start_server(kind: str, workdir: Path, **kw):
    """start_moto or start_versitygw by name ("moto" or "versitygw")."""
    return {"moto": start_moto, "versitygw": start_versitygw}[kind](workdir, **kw)


SERVER_KINDS = ("moto", "versitygw")


@pytest.fixture
def moto_server(tmp_path):
    with start_moto(tmp_path / "moto") as s:
        yield s
        print(f"{s!r} log:\n{s.log_tail()}")  # shown only when the test failed


@pytest.fixture
def versitygw_server(tmp_path):
    with start_versitygw(tmp_path / "versitygw") as s:
        yield s
        print(f"{s!r} log:\n{s.log_tail()}")


@pytest.fixture(params=SERVER_KINDS)
def s3_server(request, tmp_path):
    """Each test that uses it runs once against moto and once against versitygw."""
    with start_server(request.param, tmp_path / request.param) as s:
        yield s
        print(f"{s!r} log:\n{s.log_tail()}")
