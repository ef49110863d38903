"""The release path under faults, simulated: a seeded scheduler runs random interleavings of
publish, approve, reject, rollback, prune, availability publish and replica stop/crash/start
against real tritonservers and a real S3-compatible store (moto), injecting faults at random
points, then checks the invariants an SRE relies on. In the spirit of Jepsen and of
FoundationDB's simulation testing: everything random is drawn from the seed, so a failing seed
replays the same schedule with the same faults (`scripts/chaos.sh --seed N`).

Faults, each drawn per command or per step:
- the command SIGKILLed after a random delay, or aborted (no unwinding, as under SIGKILL) or
  panicking at its N-th store write (the `fault-injection` build of `recsys`, RECSYS_FAULTS);
- its stdout closed before it writes;
- store errors through a proxy in front of moto: 500/503 answers (object_store retries them),
  403 ExpiredToken from some request on, latency past half the lease's lifetime;
- clock skew of the command's lease clock within the lease's tolerance;
- a replica crashed (SIGKILL), stopped, started again, or whose loads stall or fail (its own
  proxy to the store).

Invariants, after each schedule (commands ended, faults off, every replica started, one
reconcile: `recsys approve` of the version the records say serves, with the whole fleet):
1. every command ended by itself (none hung, e.g. holding its lease);
2. no lease outlived its holder by more than its lifetime;
3. the reconcile succeeds; the config names one version, approved, the newest approved one (the
   records and the config tell the same story), and its files match their recorded SHA-256;
4. every live replica serves that version, and only it;
5. no version that the config or a live replica named was ever found deleted while named
   (sampled through the whole schedule);
6. the availability object's version never went back and every object read was whole;
7. every request of a bounded load running throughout was answered (clients fail over to another
   replica on a refused or reset connection, as a Service's endpoints do; an error answer counts
   as a failure).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import http.server
import json
import os
import random
import resource
import signal
import socketserver
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from s3_harness import answer_s3_error, forward
from triton_harness import TritonServer, free_port

BUCKET = "models"
MODEL = "bert4rec"
# The lease's lifetime in the simulation (RECSYS_FAULTS lease-ttl): short, so killed holders'
# leases expire within a schedule; the heartbeat renews every quarter of it.
LEASE_TTL = 6
HISTORY = np.array([[10011403, 10011207, 10011739]], dtype=np.int64)
# How long one replica's reload may take in a command (--reload-timeout): a stalled replica makes
# each pass wait this long for it.
RELOAD_TIMEOUT = 20
# A command that has not ended after this long is a hung command (a violation): past the longest a
# command may legitimately take here, the canary's load, the rollout, the automatic rollback and
# the reconcile pass each waiting out a stalled replica, plus the lease waits.
COMMAND_BOUND = 300


class ChaosProxy:
    """An HTTP proxy in front of the S3 server whose faults the scheduler sets: `errors` answers a
    share of requests with 500 InternalError or 503 SlowDown (retried by object_store), `expire_after`
    answers 403 ExpiredToken from that many requests on, `latency` delays a share of requests by that
    many seconds, `fail_gets` answers every GET 403 (a replica whose loads fail). Its own random
    draws come from the seed. Binds 127.0.0.1."""

    def __init__(self, target_port: int, seed: int):
        self.port = free_port()
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.mode: dict = {}
        self.requests = 0
        self.injected = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                with proxy.lock:
                    proxy.requests += 1
                    mode = dict(proxy.mode)
                    draw = proxy.rng.random()
                    nth = proxy.requests
                if mode.get("fail_gets") and self.command in ("GET", "HEAD"):
                    proxy.injected += 1
                    return answer_s3_error(self, 403, "AccessDenied")
                if mode.get("expire_after") is not None and nth - mode["start"] >= mode["expire_after"]:
                    proxy.injected += 1
                    return answer_s3_error(self, 403, "ExpiredToken")
                if draw < mode.get("errors", 0.0):
                    proxy.injected += 1
                    if draw < mode["errors"] / 2:
                        return answer_s3_error(self, 500, "InternalError")
                    return answer_s3_error(self, 503, "SlowDown")
                if mode.get("latency") and draw < mode.get("latency_share", 1.0):
                    proxy.injected += 1
                    time.sleep(mode["latency"])
                try:
                    forward(self, target_port, body)
                except OSError:
                    answer_s3_error(self, 503, "SlowDown")

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                # A client killed mid-request (a SIGKILLed command, a crashed replica) is part of
                # the simulation, not a proxy failure.
                pass

        self.server = Server(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def uri(self, prefix: str) -> str:
        return f"s3://127.0.0.1:{self.port}/{BUCKET}/{prefix}"

    def set(self, **mode) -> None:
        with self.lock:
            self.mode = {**mode, "start": self.requests}

    def clear(self) -> None:
        self.set()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FailoverLoad:
    """Client threads asking the live traffic replicas for answers throughout the schedule. A
    refused or reset connection (a replica stopping, crashed, starting) is tried on another live
    replica, as a Service's endpoints would route; an answer that is an error counts as a failure,
    and so does a request no replica could take. Bounded in time and requests."""

    def __init__(self, replicas: "list[Replica]", threads: int = 2, max_seconds: float = 900):
        self.replicas = replicas
        self.failures: list[str] = []
        self.answers = 0
        self.stop = threading.Event()
        self.deadline = time.monotonic() + max_seconds
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(threads)]
        self.body = json.dumps({"inputs": [{"name": "ITEM_IDS", "datatype": "INT64", "shape": [1, 3],
                                            "data": HISTORY[0].tolist()}]}).encode()

    def start(self) -> "FailoverLoad":
        for t in self.threads:
            t.start()
        return self

    def ask(self, url: str) -> str | None:
        """None: the connection failed (try another replica); else "" or the error."""
        request = urllib.request.Request(f"http://{url}/v2/models/{MODEL}/infer", data=self.body, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                json.loads(r.read())
                return ""
        except urllib.error.HTTPError as e:
            return f"{url}: HTTP {e.code} {e.read()[:200]!r}"
        except (ConnectionError, urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException):
            return None

    def run(self, index: int) -> None:
        rng = random.Random(index)
        while not self.stop.is_set() and time.monotonic() < self.deadline and self.answers < 200_000:
            live = [r for r in self.replicas if r.routable()]
            rng.shuffle(live)
            urls = [server.http_url for server in (r.server for r in live) if server is not None]
            outcome = None
            for url in urls[:3]:
                outcome = self.ask(url)
                if outcome is not None:
                    break
            if outcome is None:
                if live:
                    self.failures.append(f"no live replica took the request ({[r.name for r in live]})")
                else:
                    time.sleep(0.05)  # the whole fleet is down: a Service would have no endpoint
                continue
            if outcome:
                self.failures.append(outcome)
            else:
                self.answers += 1
            time.sleep(0.01)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


class Replica:
    """A tritonserver of the fleet, loading through its own proxy to the store."""

    def __init__(self, name: str, work: Path, s3_port: int, prefix: str, backend_dir: Path, seed: int):
        self.name = name
        self.work = work
        self.proxy = ChaosProxy(s3_port, seed)
        self.prefix = prefix
        self.backend_dir = backend_dir
        self.server: TritonServer | None = None
        self.starts = 0
        # Taken out of the endpoints before it stops, as a pod's preStop wait does.
        self.draining = False

    def start(self) -> None:
        self.draining = False
        self.starts += 1
        self.server = TritonServer(self.proxy.uri(self.prefix), self.backend_dir, explicit=True, load_models=[MODEL],
                                   log_path=self.work / f"{self.name}-{self.starts}.log",
                                   extra_args=["--exit-on-error=false", "--strict-readiness=true"])
        # A replica that starts loads what the config names; with faults on its link it may stay
        # unready, which is a state the fleet must live with (its pod would be alive, unready).
        try:
            self.server.start(timeout=120, until="live")
        except (RuntimeError, TimeoutError):
            self.server = None
            raise

    def routable(self) -> bool:
        """Whether a Service would send it traffic: the process runs and it answers ready."""
        server = self.server
        return not self.draining and server is not None and server.process is not None \
            and server.process.poll() is None and server.is_ready()

    def alive(self) -> bool:
        return self.server is not None and self.server.process is not None and self.server.process.poll() is None

    def crash(self) -> None:
        if self.alive():
            os.killpg(self.server.process.pid, signal.SIGKILL)
            self.server.process.wait(30)
        self.server = None

    def stop(self) -> None:
        if self.server is not None:
            self.draining = True
            time.sleep(1.0)  # requests routed before the drain finish
            self.server.stop()
        self.server = None

    def url(self) -> str:
        return f"http://{self.server.http_url}"

    def ready_versions(self) -> list[str] | None:
        try:
            with urllib.request.urlopen(f"{self.url()}/v2/models/{MODEL}", timeout=5) as r:
                return sorted(json.loads(r.read())["versions"])
        except Exception:  # noqa: BLE001  (not ready, or no model)
            return None

    def close(self) -> None:
        self.stop()
        self.proxy.close()


@dataclass
class Command:
    """One release command as run, with what was injected into it."""
    args: list[str]
    faults: dict
    process: subprocess.Popen | None = None
    started: float = 0.0
    ended: float | None = None
    ended_unix: float | None = None
    code: int | None = None
    output: str = ""
    hung: bool = False


@dataclass
class Outcome:
    seed: int
    steps: list[str] = field(default_factory=list)
    faults: dict = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    exit_codes: dict = field(default_factory=dict)
    answers: int = 0
    seconds: float = 0.0

    def count(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1

    def to_json(self) -> dict:
        return {"seed": self.seed, "steps": self.steps, "faults": self.faults, "violations": self.violations,
                "exit_codes": self.exit_codes, "answers": self.answers, "seconds": round(self.seconds, 1)}


class Simulation:
    """One seed's schedule on a fresh repository prefix and a fresh fleet."""

    def __init__(self, seed: int, work: Path, recsys_bin: Path, backend_dir: Path, s3, engines: dict[str, Path],
                 steps: int = 8):
        self.seed = seed
        self.rng = random.Random(seed)
        self.work = work
        self.recsys_bin = recsys_bin
        self.backend_dir = backend_dir
        self.s3 = s3
        self.engines = engines
        self.steps = steps
        self.prefix = f"chaos/{seed}"
        self.outcome = Outcome(seed)
        self.store = ChaosProxy(s3.port, seed * 7919 + 1)
        self.commands: list[Command] = []
        self.running: list[Command] = []
        self.sampler_stop = threading.Event()
        self.availability_seen: list[int] = []

    # ---- the store, read directly (no proxy, no faults) ----

    def s3_client(self):
        return self.s3.client()

    def read(self, key: str) -> bytes | None:
        try:
            return self.s3_client().get_object(Bucket=BUCKET, Key=f"{self.prefix}/{key}")["Body"].read()
        except Exception:  # noqa: BLE001  (absent)
            return None

    def config_versions(self) -> list[int] | None:
        text = self.read(f"{MODEL}/config.pbtxt")
        if text is None:
            return None
        text = text.decode()
        if "versions: [" not in text:
            return None
        inner = text.split("versions: [", 1)[1].split("]", 1)[0]
        return [int(v) for v in inner.replace(",", " ").split()]

    def records(self) -> dict[int, dict]:
        listed = self.s3_client().list_objects_v2(Bucket=BUCKET, Prefix=f"{self.prefix}/{MODEL}/")
        out = {}
        for item in listed.get("Contents", []):
            parts = item["Key"].split("/")
            if parts[-1] == "recsys-version.json" and parts[-2].isdigit():
                body = self.read(f"{MODEL}/{parts[-2]}/recsys-version.json")
                if body:
                    with contextlib.suppress(ValueError):
                        out[int(parts[-2])] = json.loads(body)
        return out

    def version_files(self, version: int) -> dict[str, bytes]:
        listed = self.s3_client().list_objects_v2(Bucket=BUCKET, Prefix=f"{self.prefix}/{MODEL}/{version}/")
        return {item["Key"].rsplit("/", 1)[1]: b"" for item in listed.get("Contents", [])}

    # ---- commands ----

    def base(self) -> list[str]:
        return ["--repository", self.store.uri(self.prefix), "--model", MODEL]

    def fleet_flags(self) -> list[str]:
        flags = []
        for r in self.traffic:
            if r.alive():
                flags += ["--server", r.url()]
        if self.canary.alive():
            flags += ["--canary", self.canary.url()]
        else:
            flags += ["--canary-on-traffic"]
        return flags

    def launch(self, args: list[str], faults: dict) -> Command:
        env = {**os.environ, "RECSYS_FAULTS": ",".join(f"{k}={v}" for k, v in faults.get("plan", {}).items())}
        stdout = subprocess.PIPE
        if faults.get("stdout_closed"):
            reader, writer = os.pipe()
            os.close(reader)
            stdout = writer
        command = Command(args=args, faults=faults)
        # No core files from the aborts the plan injects.
        no_core = lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # noqa: E731
        command.process = subprocess.Popen([str(self.recsys_bin), *args], stdout=stdout, stderr=subprocess.STDOUT,
                                           env=env, text=True, start_new_session=True, preexec_fn=no_core)
        if faults.get("stdout_closed"):
            os.close(stdout)
        command.started = time.monotonic()

        def note_the_end() -> None:
            # When it really ended (what the lease check measures from), not when it was waited for.
            command.process.wait()
            command.ended_unix = time.time()

        threading.Thread(target=note_the_end, daemon=True).start()
        self.commands.append(command)
        self.running.append(command)
        if faults.get("sigkill_after") is not None:
            threading.Timer(faults["sigkill_after"], self._kill, args=(command,)).start()
        return command

    def _kill(self, command: Command) -> None:
        with contextlib.suppress(ProcessLookupError):
            if command.process.poll() is None:
                os.killpg(command.process.pid, signal.SIGKILL)

    def wait(self, command: Command, timeout: float = COMMAND_BOUND) -> None:
        try:
            out, _ = command.process.communicate(timeout=timeout)
            command.output = out or ""
        except subprocess.TimeoutExpired:
            command.hung = True
            self._kill(command)
            out, _ = command.process.communicate(timeout=30)
            command.output = out or ""
        command.ended = time.monotonic()
        if command.ended_unix is None:
            command.ended_unix = time.time()
        command.code = command.process.returncode
        self.running.remove(command)
        name = " ".join(a for a in command.args[:1])
        self.outcome.exit_codes.setdefault(name, {}).setdefault(str(command.code), 0)
        self.outcome.exit_codes[name][str(command.code)] += 1
        if command.hung:
            self.outcome.violations.append(
                f"`recsys {' '.join(command.args)}` with faults {command.faults} did not end in {timeout} s "
                f"(killed); its output:\n{command.output[-2000:]}")

    def draw_faults(self) -> dict:
        """The faults of one command, drawn from the seed."""
        faults: dict = {"plan": {"lease-ttl": LEASE_TTL}}
        roll = self.rng.random()
        if roll < 0.15:
            faults["sigkill_after"] = round(self.rng.uniform(0.05, 3.0), 2)
            self.outcome.count("sigkill")
        elif roll < 0.30:
            kind = self.rng.choice(["abort-before-write", "abort-after-write", "panic-before-write",
                                    "panic-after-write"])
            faults["plan"][kind] = self.rng.randint(1, 12)
            self.outcome.count(kind.split("-")[0] + "-at-write")
        elif roll < 0.38:
            faults["stdout_closed"] = True
            self.outcome.count("stdout-closed")
        store_roll = self.rng.random()
        if store_roll < 0.12:
            faults["store"] = {"errors": 0.25}
            self.outcome.count("store-5xx")
        elif store_roll < 0.20:
            faults["store"] = {"expire_after": self.rng.randint(2, 30)}
            self.outcome.count("store-expired-token")
        elif store_roll < 0.27:
            # Past half the lease's lifetime: a renewal this slow is a lost lease.
            faults["store"] = {"latency": LEASE_TTL * 0.6, "latency_share": 0.3}
            self.outcome.count("store-latency")
        if self.rng.random() < 0.2:
            faults["plan"]["clock-skew"] = self.rng.choice([-1, 1])
            self.outcome.count("clock-skew")
        return faults

    # ---- the fleet ----

    def start_fleet(self) -> None:
        self.traffic = [Replica(f"r{i}", self.work, self.s3.port, self.prefix, self.backend_dir, self.seed * 31 + i)
                        for i in range(2)]
        self.canary = Replica("canary", self.work, self.s3.port, self.prefix, self.backend_dir, self.seed * 31 + 9)
        for r in [*self.traffic, self.canary]:
            r.start()

    def replicas(self) -> list[Replica]:
        return [*self.traffic, self.canary]

    def sample(self) -> None:
        """Every half second: what the config and the live replicas name, and whether each such
        version still has its files and record; the availability object's version."""
        while not self.sampler_stop.wait(0.5):
            try:
                named = set(self.config_versions() or [])
                for r in self.replicas():
                    if r.alive():
                        named |= {int(v) for v in (r.ready_versions() or [])}
                for v in named:
                    if not self.read(f"{MODEL}/{v}/recsys-version.json") and \
                            not self.version_files(v):
                        self.outcome.violations.append(f"version {v} was named (config or a live replica) "
                                                       f"while its folder was gone")
                body = self.read(f"{MODEL}/recsys-availability.bin")
                if body is not None:
                    self.check_availability(body)
            except Exception as e:  # noqa: BLE001  (a sampling hiccup is not a finding)
                _ = e

    def check_availability(self, body: bytes) -> None:
        if body[:8] != b"RSYSAVAL" or len(body) < 16:
            self.outcome.violations.append(f"the availability object is not whole ({len(body)} bytes)")
            return
        header_len = int.from_bytes(body[12:16], "little")
        header = json.loads(body[16:16 + header_len])
        payload = body[16 + header_len:]
        if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
            self.outcome.violations.append("the availability object's payload does not match its digest")
        version = header["version"]
        if self.availability_seen and version < self.availability_seen[-1]:
            self.outcome.violations.append(
                f"the availability object went back from version {self.availability_seen[-1]} to {version}")
        self.availability_seen.append(version)

    # ---- the schedule ----

    def step(self, n: int) -> None:
        rng = self.rng
        records = self.records()
        approved = sorted(v for v, r in records.items() if r.get("status") == "approved")
        others = sorted(v for v, r in records.items() if r.get("status") in ("pending", "rejected", "rolled-back"))
        kinds = ["publish", "approve", "approve", "reject", "rollback", "prune", "availability", "replica"]
        kind = rng.choice(kinds)
        faults = self.draw_faults()
        concurrent = rng.random() < 0.3
        args: list[str] | None = None
        if kind == "publish":
            engine = self.engines[rng.choice(sorted(self.engines))]
            args = ["publish", "--engine", str(engine), *self.base()]
        elif kind == "approve" and (others or approved):
            version = rng.choice(others or approved)
            args = ["approve", "--version", str(version), *self.fleet_flags(), "--lease-wait", "20",
                    "--reload-timeout", str(RELOAD_TIMEOUT), *self.base()]
        elif kind == "reject" and approved:
            args = ["reject", "--version", str(rng.choice(approved)), *self.fleet_flags(), "--lease-wait", "20",
                    "--reload-timeout", str(RELOAD_TIMEOUT), *self.base()]
        elif kind == "rollback":
            args = ["rollback", *self.fleet_flags(), "--lease-wait", "20", "--reload-timeout", str(RELOAD_TIMEOUT),
                    *self.base()]
        elif kind == "prune":
            # Every replica of the fleet, the canary included: prune keeps what any of them serves.
            args = ["versions", "--prune", "--keep", str(rng.randint(1, 3)), "--lease-wait", "20",
                    *[f for r in self.replicas() if r.alive() for f in ("--server", r.url())], *self.base()]
        elif kind == "availability":
            table = self.work / f"stock-{self.seed}-{n}.tsv"
            ids = [10011403, 10011207, 10011739, 10012068, 10011426]
            table.write_text("item_id\tstock\n" + "".join(f"{i}\t{rng.choice(['in', 'out'])}\n" for i in ids))
            args = ["availability", "publish", *self.base(), str(table)]
        if kind == "replica":
            replica = rng.choice(self.replicas())
            action = rng.choice(["crash", "stop", "start", "stall", "fail-loads"])
            self.outcome.steps.append(f"{n}: replica {replica.name} {action}")
            self.outcome.count(f"replica-{action}")
            if action == "crash":
                replica.crash()
            elif action == "stop":
                replica.stop()
            elif action == "start" and not replica.alive():
                with contextlib.suppress(RuntimeError, TimeoutError):
                    replica.start()
            elif action == "stall":
                replica.proxy.set(latency=8.0, latency_share=0.5)
            elif action == "fail-loads":
                replica.proxy.set(fail_gets=True)
            return
        if args is None:
            return
        if not concurrent:
            for running in list(self.running):
                self.wait(running)
        self.store.set(**faults.get("store", {}))
        self.outcome.steps.append(f"{n}: recsys {' '.join(a for a in args if not a.startswith('s3://'))}"
                                  f" faults={ {k: v for k, v in faults.items()} }"
                                  + (" (concurrent)" if concurrent else ""))
        self.launch(args, faults)

    def lease_check(self) -> None:
        body = self.read(f"{MODEL}/recsys-lease.json")
        if body is None:
            return
        lease = json.loads(body)
        pid = int(lease["holder"].rsplit("pid", 1)[1].split()[0]) if "pid" in lease["holder"] else None
        holder = next((c for c in self.commands if c.process.pid == pid), None)
        if holder is None or holder.ended_unix is None:
            return
        skew = max(abs(int(c.faults.get("plan", {}).get("clock-skew", 0))) for c in self.commands)
        outlived = lease["expires_at_unix"] - holder.ended_unix
        if outlived > LEASE_TTL + skew + 1:
            self.outcome.violations.append(
                f"the lease of `{lease['command']}` (pid {pid}) expires {outlived:.0f} s after its holder ended "
                f"(lifetime {LEASE_TTL} s)")

    def reconcile_and_check(self) -> None:
        for r in self.replicas():
            r.proxy.clear()
            if not r.alive():
                with contextlib.suppress(RuntimeError, TimeoutError):
                    r.start()
        records = self.records()
        approved = sorted(v for v, r in records.items() if r.get("status") == "approved")
        if not approved:
            self.outcome.violations.append(f"no approved version is left (records: "
                                           f"{ {v: r.get('status') for v, r in records.items()} })")
            return
        serving = approved[-1]
        reconcile = subprocess.run(
            [str(self.recsys_bin), "approve", "--version", str(serving), *self.fleet_flags(), "--lease-wait",
             str(LEASE_TTL * 4), "--reload-timeout", "120", "--repository", self.s3.uri(BUCKET, self.prefix),
             "--model", MODEL],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "RECSYS_FAULTS": f"lease-ttl={LEASE_TTL}"})
        if reconcile.returncode != 0:
            self.outcome.violations.append(f"the reconcile (approve --version {serving}) exited "
                                           f"{reconcile.returncode}:\n{reconcile.stdout[-2000:]}\n"
                                           f"{reconcile.stderr[-2000:]}")
        records = self.records()
        approved = sorted(v for v, r in records.items() if r.get("status") == "approved")
        config = self.config_versions()
        if config != [serving] or not approved or approved[-1] != serving:
            self.outcome.violations.append(f"the config names {config}, the records' newest approved version is "
                                           f"{approved[-1] if approved else None}")
        record = records.get(serving, {})
        for name, digest in (record.get("checksums") or {}).items():
            body = self.read(f"{MODEL}/{serving}/{name}")
            if body is None or hashlib.sha256(body).hexdigest() != digest:
                self.outcome.violations.append(f"version {serving}'s {name} is missing or does not match its "
                                               f"recorded SHA-256")
        for r in self.replicas():
            if r.alive():
                versions = r.ready_versions()
                if versions != [str(serving)]:
                    self.outcome.violations.append(f"replica {r.name} serves {versions} after the reconcile, "
                                                   f"not [{serving}]")

    def run(self) -> Outcome:
        started = time.monotonic()
        # The first version, approved, before the fleet starts (a pod needs one to load).
        first = subprocess.run([str(self.recsys_bin), "publish", "--approve", "--engine",
                                str(self.engines["fp32"]), "--repository", self.s3.uri(BUCKET, self.prefix),
                                "--model", MODEL], capture_output=True, text=True, timeout=300)
        assert first.returncode == 0, first.stdout + first.stderr
        self.start_fleet()
        load = FailoverLoad(self.traffic).start()
        sampler = threading.Thread(target=self.sample, daemon=True)
        sampler.start()
        try:
            for n in range(self.steps):
                self.step(n)
                time.sleep(self.rng.uniform(0.0, 1.5))
            for running in list(self.running):
                self.wait(running)
            self.store.clear()
            self.lease_check()
            self.reconcile_and_check()
            time.sleep(1.0)  # the load's answers after the reconcile
        finally:
            self.sampler_stop.set()
            sampler.join(30)
            load.finish()
            for running in list(self.running):
                self._kill(running)
                self.wait(running, timeout=30)
            for r in self.replicas():
                r.close()
            self.store.close()
        if load.failures:
            self.outcome.violations.append(f"{len(load.failures)} request(s) failed, first: {load.failures[:3]}")
        self.outcome.answers = load.answers
        self.outcome.seconds = time.monotonic() - started
        # A violation found by the sampler may repeat every half second: once is enough.
        self.outcome.violations = list(dict.fromkeys(self.outcome.violations))
        return self.outcome


def main() -> int:
    """`scripts/chaos.sh`: many seeds in a row, a line per seed, a summary at the end (JSON in
    --summary); exit 1 if any seed found a violation."""
    import argparse  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from conftest import convert  # noqa: PLC0415
    from s3_harness import CREDENTIALS, S3Server  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="how many seeds to run")
    parser.add_argument("--first", type=int, default=1, help="the first seed")
    parser.add_argument("--seed", type=int, help="replay this one seed")
    parser.add_argument("--steps", type=int, default=8, help="steps per schedule")
    parser.add_argument("--recsys", type=Path, required=True, help="recsys built with --features fault-injection")
    parser.add_argument("--plain-recsys", type=Path, required=True, help="the shipped recsys (converts the engines)")
    parser.add_argument("--backend-dir", type=Path, required=True)
    parser.add_argument("--summary", type=Path, help="write the summary JSON here")
    parser.add_argument("--max-minutes", type=float, default=600, help="stop starting seeds after this long")
    args = parser.parse_args()
    seeds = [args.seed] if args.seed is not None else list(range(args.first, args.first + args.seeds))
    os.environ.update(CREDENTIALS)
    started = time.monotonic()
    totals: dict = {"seeds_run": 0, "faults_injected": {}, "violations": 0, "failing_seeds": [], "answers": 0}
    with tempfile.TemporaryDirectory(prefix="recsys-chaos-") as tmp:
        work = Path(tmp)
        engines = {"fp32": work / "fp32", "int8": work / "int8"}
        convert(args.plain_recsys, "bert4rec", "bert4rec", "model.pt", engines["fp32"])
        convert(args.plain_recsys, "bert4rec", "bert4rec", "model.safetensors", engines["int8"],
                extra=["--precision", "int8"])
        with S3Server(work / "moto.log") as s3:
            s3.client().create_bucket(Bucket=BUCKET)
            for seed in seeds:
                if time.monotonic() - started > args.max_minutes * 60:
                    print(f"stopping after {args.max_minutes} minutes", flush=True)
                    break
                seed_dir = work / f"seed-{seed}"
                seed_dir.mkdir()
                outcome = Simulation(seed, seed_dir, args.recsys, args.backend_dir, s3, engines,
                                     steps=args.steps).run()
                totals["seeds_run"] += 1
                totals["answers"] += outcome.answers
                for kind, n in outcome.faults.items():
                    totals["faults_injected"][kind] = totals["faults_injected"].get(kind, 0) + n
                totals["violations"] += len(outcome.violations)
                if outcome.violations:
                    totals["failing_seeds"].append(seed)
                    print(json.dumps(outcome.to_json(), indent=1), flush=True)
                print(f"seed {seed}: {len(outcome.violations)} violation(s), {sum(outcome.faults.values())} "
                      f"fault(s), {outcome.answers} answers, {outcome.seconds:.0f} s", flush=True)
    totals["faults_total"] = sum(totals["faults_injected"].values())
    totals["minutes"] = round((time.monotonic() - started) / 60, 1)
    print(json.dumps(totals, indent=1, sort_keys=True), flush=True)
    if args.summary:
        # A relative path is the caller's (scripts/chaos.sh runs this from tests/integration).
        summary = Path(os.environ.get("RECSYS_CALLER_DIR", ".")) / args.summary
        summary.parent.mkdir(parents=True, exist_ok=True)
        summary.write_text(json.dumps(totals, indent=1, sort_keys=True))
    return 1 if totals["violations"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
