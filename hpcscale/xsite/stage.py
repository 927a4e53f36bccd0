"""Staging: copy what a manifest lists from one endpoint to another; only what is missing or differs, each file
verified by hash before it takes its name, resumable, in parallel streams. Guide: docs/staging.md.

Endpoints are local (or shared-filesystem) paths and `ssh://[user@]host[:port]/path`. For ssh, each stream is
one `ssh host python3 -c ...` process running hpcscale.xsite.agent, which travels over the connection with
the hpcscale.portable modules it imports (hpcscale/xsite/bootstrap.py), so the other site needs only python3.
Both ends place and read files with the same code (hpcscale.portable.sink, hpcscale.portable.source). This
module is also the library the cross-site rounds use to move model contributions (`stage_files`).

Over ssh the other end is another site's and is not trusted (hpcscale.xsite.channel): its plan is checked
entry by entry (`check_plan`), every ack must name a file in flight on its stream, once (`check_ack`), every
get reply must announce exactly the bytes asked for (`check_get`); a violation fails the stage (exit 1) with
ssh stopped, and a receiver thread that ends for any reason ends the stage with it. The summary counts what
this side saw: up to date are the entries the checked plan marks so, sent the files acknowledged one by one,
and the remote's count of files it proved by hash is accepted only up to that up-to-date count.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from hpcscale.data.manifest import Manifest, manifest_text
from hpcscale.errors import BadInput, RuntimeFailure, VerificationFailure
from hpcscale.portable.errors import StageError
from hpcscale.portable.hashing import BLOCK
from hpcscale.portable.sink import TMPFILE_MAX, UP_TO_DATE, Plan, Sink
from hpcscale.portable.source import Source
from hpcscale.portable.wire import TokenBucket, pump, send
from hpcscale.util.progress import Progress
from hpcscale.xsite import DEFAULT_JOBS, copiers
from hpcscale.xsite.channel import (
    Channel,
    Endpoint,
    ProtocolError,
    check_error,
    error_for,
    parse_endpoint,
    shown,
    stall_timeout,
)

log = logging.getLogger("hpcscale.stage")

WINDOW = 64  # get requests in flight per pull stream


@dataclass(slots=True)
class StageOptions:
    jobs: int = DEFAULT_JOBS
    check: str = "stat"  # how files already at the destination are proven: "stat" (record) or "hash"
    bwlimit: float | None = None  # bytes per second, all streams together
    dry_run: bool = False
    sync: bool = False  # syncfs the destination before its manifest and record are written
    umask: int = 0  # permission bits cleared from every file's mode at the destination (--umask)
    ssh: Sequence[str] = ("ssh",)
    remote_python: str = "python3"


@dataclass(slots=True)
class StageResult:
    source: str
    destination: str
    hash_algorithm: str
    files: int = 0
    bytes_total: int = 0
    up_to_date: int = 0
    proven_by_hash: int = 0  # of up_to_date: hashed at the destination in this run (no record, or --check hash)
    sent: int = 0
    resumed: int = 0
    bytes_sent: int = 0
    verified: int = 0  # files whose hash was checked in this run (sent + proven_by_hash)
    failed: list[dict] = field(default_factory=list)
    would_send: list[str] = field(default_factory=list)
    dry_run: bool = False
    committed: bool = False
    seconds: float = 0.0
    streams: int = 0  # parallel streams that carried this run: copier processes or threads (local), ssh connections
    bwlimit: float | None = None  # the cap in bytes/s, all streams together; None: none
    # why DST's record of verified files was not trusted (others could have written it: every file there was
    # hashed instead); None when it was, or when there was none (the sink's plan info 'record_ignored')
    record_ignored: str | None = None

    @property
    def mb_per_s(self) -> float:
        return self.bytes_sent / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["mb_per_s"] = round(self.mb_per_s, 2)
        doc["seconds"] = round(self.seconds, 3)
        doc["skipped"] = self.up_to_date
        return doc


class _Run:
    """Shared state of one stage: the result, its lock, the first fatal error."""

    def __init__(self, result: StageResult, progress: Progress, bucket: TokenBucket | None):
        self.result = result
        self.progress = progress
        self.bucket = bucket
        self.lock = threading.Lock()
        self.fatal: BaseException | None = None
        self.stop = threading.Event()

    def ok(self, resumed: bool) -> None:
        with self.lock:
            self.result.sent += 1
            self.result.verified += 1
            self.result.resumed += int(resumed)
        self.progress.advance(files=1)

    def sent_bytes(self, n: int) -> None:
        with self.lock:
            self.result.bytes_sent += n
        self.progress.advance(nbytes=n)

    def fail(self, path: str | None, message: str, kind: str) -> None:
        with self.lock:
            self.result.failed.append({"path": path, "error": message, "kind": kind})
        if kind == "input" or path is None:
            self.abort(error_for(message, kind))

    def abort(self, e: BaseException) -> None:
        with self.lock:
            if self.fatal is None:
                self.fatal = e
        self.stop.set()


def _open_channels(
    ep: Endpoint, role: str, agent_opts: dict, opts: StageOptions, n: int, on_open=None
) -> list[Channel]:
    """n streams connected in parallel; on_open(channel) is called as each one comes up."""

    def connect() -> Channel:
        ch = Channel(ep, role, opts.ssh, opts.remote_python)
        try:
            ch.init(agent_opts)
        except BaseException:
            ch.close()
            raise
        if on_open is not None:
            on_open(ch)
        return ch

    if n <= 0:
        return []
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(connect) for _ in range(n)]
        channels, error = [], None
        for f in futures:
            try:
                channels.append(f.result())
            except Exception as e:
                error = error or e
    if error is not None and on_open is not None:
        # extra streams joining a transfer: those that came up are already working; carry on with them
        log.debug("stage: an extra stream failed to connect: %s", error)
        return channels
    if error is not None:
        for c in channels:
            c.close()
        raise error
    return channels


def stage(
    manifest: Manifest,
    manifest_text: str | None,
    src: Endpoint,
    dst: Endpoint,
    opts: StageOptions,
    progress: Progress | None = None,
    early: Channel | None = None,
) -> StageResult:
    """Copy `manifest`'s files from src to dst. Writes `manifest_text` as dst/manifest.json last, when every file
    is in place. Raises BadInput (2), VerificationFailure (3) or RuntimeFailure (1) after doing what it could;
    the result so far is attached to the error as `.result`. `early`: a connection begun by channel.connect_early()."""
    try:
        return _stage(manifest, manifest_text, src, dst, opts, progress, early)
    finally:
        if early is not None and not early.taken:
            early.close()


def _take(early: Channel | None) -> Channel | None:
    if early is not None:
        early.taken = True
    return early


def _stage(manifest, manifest_text, src, dst, opts, progress, early) -> StageResult:
    if src.kind == "ssh" and dst.kind == "ssh":
        raise BadInput("stage: one side must be local (run hpcscale stage on one of the two hosts)")
    if opts.check not in ("stat", "hash"):
        raise BadInput(f"--check: '{opts.check}' is not stat or hash")
    if manifest_text is not None and any(f.path == "manifest.json" for f in (*manifest.files, *manifest.dirs)):
        manifest_text = None  # the tree has its own file (or directory) of that name; never overwrite it with ours
    entries = [[f.path, f.size, f.mtime_ns, f.hash, f.mode] for f in manifest.files]
    dirs = [[d.path, d.mode] for d in manifest.dirs] if manifest.dirs else None
    result = StageResult(str(src), str(dst), manifest.hash_algorithm, dry_run=opts.dry_run, bwlimit=opts.bwlimit)
    result.files = len(entries)
    result.bytes_total = sum(f.size for f in manifest.files)
    run = _Run(result, progress or Progress(), TokenBucket(opts.bwlimit) if opts.bwlimit else None)
    t0 = time.perf_counter()
    try:
        if dst.kind == "ssh":
            _push(entries, dirs, manifest_text, Source(src.path), dst, opts, run, manifest.hash_algorithm, early)
        else:
            sink = Sink(
                dst.path,
                manifest.hash_algorithm,
                dry_run=opts.dry_run,
                sync=opts.sync,
                jobs=opts.jobs,
                umask=opts.umask,
            )
            try:
                if src.kind == "ssh":
                    _pull(entries, dirs, manifest_text, src, sink, opts, run, early)
                else:
                    _local(entries, dirs, manifest_text, Source(src.path), sink, opts, run)
            finally:
                sink.close()
    except StageError as e:
        run.abort(error_for(str(e), e.kind))
    except OSError as e:
        run.abort(RuntimeFailure(str(e)))
    except (BadInput, VerificationFailure, RuntimeFailure) as e:
        run.abort(e)
    result.seconds = time.perf_counter() - t0
    error = run.fatal
    if error is None and result.failed:
        verify = [f for f in result.failed if f["kind"] == "verify"]
        lines = "\n  ".join(f"{f['path']}: {f['error']}" for f in result.failed)
        cls = VerificationFailure if len(verify) == len(result.failed) else RuntimeFailure
        error = cls(f"{len(result.failed)} of {result.files} files failed (rerun to retry):\n  {lines}")
    if error is not None:
        error.result = result  # type: ignore[attr-defined]
        raise error
    return result


def _sha256(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


def check_plan(reply: dict, entries: list) -> Plan:
    """A remote plan reply's Plan, each field checked against the request (ProtocolError): one
    status per entry, each -1 (up to date) or an offset within the file's manifest size; info an object whose
    counts are integers >= 0, 'proven' at most the number of entries up to date; 'clean' a boolean, 'lock' a
    short string or null."""
    statuses = reply.get("statuses")
    if type(statuses) is not list or len(statuses) != len(entries):
        what = f"{len(statuses)} statuses" if type(statuses) is list else f"statuses {shown(repr(statuses), 40)}"
        raise ProtocolError(f"a plan reply with {what} for {len(entries)} files")
    for s, e in zip(statuses, entries, strict=True):
        if type(s) is not int or s < -1 or s > e[1]:
            raise ProtocolError(f"a plan reply with status {shown(repr(s), 40)} for '{e[0]}' ({e[1]} bytes)")
    info = reply.get("info", {})
    if type(info) is not dict:
        raise ProtocolError(f"a plan reply whose info is {shown(repr(info), 40)}")
    for key in Plan.COUNTS:
        value = info.get(key, 0)
        if type(value) is not int or value < 0:
            raise ProtocolError(f"a plan reply whose info.{key} is {shown(repr(value), 40)}")
    up_to_date = statuses.count(-1)
    if info.get("proven", 0) > up_to_date:
        raise ProtocolError(f"a plan reply claiming {info['proven']} files proven by hash of {up_to_date} up to date")
    if type(reply.get("clean", False)) is not bool:
        raise ProtocolError(f"a plan reply whose clean is {shown(repr(reply.get('clean')), 40)}")
    lock = reply.get("lock")
    if lock is not None and (type(lock) is not str or len(lock) > 200):
        raise ProtocolError(f"a plan reply whose lock is {shown(repr(lock), 40)}")
    ignored = info.get("record_ignored")
    if ignored is not None and (type(ignored) is not str or len(ignored) > 2000):
        raise ProtocolError(f"a plan reply whose info.record_ignored is {shown(repr(ignored), 40)}")
    return Plan.from_wire(statuses, info)


def check_ack(msg: dict, inflight: dict) -> tuple[str | None, tuple[str, str] | None]:
    """A push stream's reply, between its puts and its flush: (path, None) for an ack of a file in flight,
    (path, (message, kind)) for an error (path None: one about the whole stream), ('', None) for 'flushed';
    ProtocolError for anything else, an ack of a file not in flight (or acknowledged already) included."""
    if "flushed" in msg:
        if msg.get("flushed") is not True or len(msg) != 1:
            raise ProtocolError("a flush reply that is not {flushed: true}")
        return "", None
    path = msg.get("path")
    if "error" in msg:
        error = check_error(msg)
        if path is not None and (type(path) is not str or path not in inflight):
            raise ProtocolError(f"an error reply for '{shown(path, 200)}', which is not in flight")
        return path, error
    if msg.get("ok") is not True:
        raise ProtocolError(f"a reply that is neither an ack nor an error (keys {shown(sorted(msg)[:8], 200)})")
    if type(path) is not str or path not in inflight:
        raise ProtocolError(f"an ack for '{shown(path, 200)}', which is not in flight (or acknowledged already)")
    return path, None


def check_get(msg: dict, entry: list, offset: int) -> tuple[str, str] | None:
    """A pull stream's reply to a get of `entry` from `offset`: None where exactly the file's remaining
    manifest bytes follow, (message, kind) for an error reply (nothing follows); ProtocolError otherwise."""
    if "error" in msg:
        return check_error(msg)
    n, size, path = msg.get("n"), msg.get("size"), msg.get("path")
    if path != entry[0]:
        raise ProtocolError(f"a reply for '{shown(path, 200)}' to a get of '{entry[0]}'")
    if type(n) is not int or n != entry[1] - offset or type(size) is not int or size != entry[1]:
        raise ProtocolError(
            f"a reply announcing {shown(repr(n), 40)} bytes of a {shown(repr(size), 40)}-byte '{entry[0]}' (asked for "
            f"{entry[1] - offset} from offset {offset} of {entry[1]})"
        )
    return None


def _apply_plan(entries: list, plan: Plan, run: _Run) -> list[tuple[list, int]]:
    r = run.result
    todo = []
    for entry, status in zip(entries, plan.statuses, strict=True):
        if status == UP_TO_DATE:
            r.up_to_date += 1
        else:
            todo.append((entry, status))
    r.proven_by_hash = plan.proven
    r.verified += r.proven_by_hash
    if isinstance(plan.record_ignored, str):  # a local sink's, or one check_plan let through
        r.record_ignored = shown(plan.record_ignored, 2000)
    r.would_send = [e[0] for e, _ in todo]

    # Large files first, largest first, so that parallel streams finish together; then the small ones in path
    # order, as the manifest lists them: files of one directory sit together on disk (sampled thread time in
    # reads of a cold 10k-file local copy fell by 40%; its wall time did not move beyond the noise).
    def order(item: tuple[list, int]) -> tuple[int, int]:
        left = item[0][1] - item[1]
        return (0, -left) if left >= TMPFILE_MAX else (1, 0)  # stable: small ones keep path order

    todo.sort(key=order)
    run.progress.start(len(todo), sum(e[1] - off for e, off in todo))
    return todo


def _complete(run: _Run, todo: int) -> bool:
    """Whether every listed file is proven in place: up to date by the plan, or acknowledged as verified and
    placed, one by one (`todo` of them), and nothing failed. Anything else, including a worker that ended
    without a word, blocks the commit: a destination manifest then never vouches for a missing file."""
    with run.lock:
        if run.fatal is None and not run.result.failed and run.result.sent < todo:
            run.result.failed.append(
                {
                    "path": None,
                    "error": f"only {run.result.sent} of {todo} files were confirmed in place",
                    "kind": "runtime",
                }
            )
        return run.fatal is None and not run.result.failed


def _commit(sink: Sink, manifest_text: str | None, run: _Run, todo: int) -> None:
    """Record and manifest at a local destination, only when every file made it."""
    sink.flush()
    if _complete(run, todo):
        sink.commit(manifest_text)
        run.result.committed = True


def _local(entries, dirs, manifest_text, source: Source, sink: Sink, opts: StageOptions, run: _Run) -> None:
    todo = _apply_plan(entries, sink.plan(entries, opts.check, _sha256(manifest_text), dirs=dirs), run)
    if opts.dry_run:
        return
    n = copiers.processes_for(opts.jobs, len(todo))
    if not (n and copiers.copy_in_processes(todo, source, sink, opts.bwlimit, run, n)):
        _local_threads(todo, source, sink, opts, run)
    _commit(sink, manifest_text, run, len(todo))


def _local_threads(todo, source: Source, sink: Sink, opts: StageOptions, run: _Run) -> None:
    """The copy in this process: where there are no copier processes (one job or one file, or a caller that is
    not the main thread). One thread opens the files ahead of the copiers (each with FADV_WILLNEED), so their
    cold opens and reads overlap the copying."""
    work: queue.SimpleQueue = queue.SimpleQueue()
    for item in todo:
        work.put(item)
    files = _Prefetch(work, source, run)

    def worker() -> None:
        while not run.stop.is_set():
            item = files.next()
            if item is None:
                return
            entry, offset, fd = item
            problem = copiers.copy_file(sink, entry, offset, fd, run.bucket, run.sent_bytes)
            if problem is None:
                run.ok(offset > 0)
            else:
                run.fail(entry[0], *problem)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, min(opts.jobs, len(todo))))]
    run.result.streams = len(threads)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    files.close()  # after a fatal error: files opened ahead and never copied


def _push(entries, dirs, manifest_text, source: Source, dst: Endpoint, opts: StageOptions, run: _Run, algorithm, early):
    agent_opts = {
        "algorithm": algorithm,
        "dry_run": opts.dry_run,
        "sync": opts.sync,
        "jobs": opts.jobs,
        "umask": opts.umask,
        "beat_s": stall_timeout() / 4,  # a long plan, flush or commit says it is alive well within our timeout
    }
    n = max(1, opts.jobs)
    t0 = time.perf_counter()
    ch0 = _take(early) or Channel(dst, "sink", opts.ssh, opts.remote_python)
    first = [ch0]
    try:
        # init and plan in one round trip
        request = {"op": "plan", "entries": entries, "check": opts.check, "manifest_sha256": _sha256(manifest_text)}
        if dirs is not None:
            request["dirs"] = dirs
        reply = ch0.call({"op": "init", "opts": agent_opts}, request)
        try:
            plan = check_plan(reply, entries)
        except ProtocolError as e:
            raise ch0.violation(str(e)) from None
    except BaseException:
        ch0.close()
        raise
    log.debug("push: planned at %.3f s", time.perf_counter() - t0)
    todo = _apply_plan(entries, plan, run)
    agent_opts["lock"] = reply.get("lock")  # extra streams join the lock the first one took
    channels = first
    try:
        if opts.dry_run or not todo:
            if not opts.dry_run:
                if not reply.get("clean"):  # a clean no-op: the destination already holds this commit
                    first[0].call({"op": "commit", "manifest": manifest_text})
                run.result.committed = True
                log.debug("push: committed at %.3f s", time.perf_counter() - t0)
            return
        work: queue.SimpleQueue = queue.SimpleQueue()
        for item in todo:
            work.put(item)
        threads: list[threading.Thread] = []
        lock = threading.Lock()

        def serve(ch: Channel) -> None:
            inflight: dict[str, int] = {}
            pair = [
                threading.Thread(target=_push_sender, args=(ch, work, source, run, inflight), daemon=True),
                threading.Thread(target=_push_receiver, args=(ch, run, inflight), daemon=True),
            ]
            with lock:
                threads.extend(pair)
            for t in pair:
                t.start()

        def join_late() -> None:
            """More streams connect while the first one already sends; each takes work as soon as it is up."""
            late = _open_channels(dst, "sink", agent_opts, opts, more, on_open=serve)
            with lock:
                channels.extend(late)

        serve(first[0])
        more = min(n, len(todo)) - 1
        opener = threading.Thread(target=join_late, daemon=True) if more > 0 else None
        if opener is not None:
            opener.start()
            opener.join()
        i = 0
        while True:
            with lock:
                if i >= len(threads):
                    break
                t = threads[i]
            t.join()
            i += 1
        log.debug("push: data sent and acknowledged at %.3f s", time.perf_counter() - t0)
        if _complete(run, len(todo)):
            channels[0].call({"op": "commit", "manifest": manifest_text})
            run.result.committed = True
        log.debug("push: committed at %.3f s", time.perf_counter() - t0)
    finally:
        run.result.streams = len(channels)
        for ch in channels:
            ch.close()
        log.debug("push: closed at %.3f s", time.perf_counter() - t0)


class _Prefetch:
    """A thread that opens the next files ahead of their consumers, each with POSIX_FADV_WILLNEED: on a cold
    disk an open is a metadata read and the data a second one, and done in the consumer's thread they stall it.
    One per ssh sender; one shared by the copiers of a local copy. `next()` returns (entry, offset, fd), or None
    to every consumer once the work is done. A file that cannot be opened is failed; the opener itself never
    ends quietly (anything unexpected aborts the run)."""

    AHEAD = 256

    def __init__(self, work: queue.SimpleQueue, source: Source, run: _Run):
        self.work, self.source, self.run = work, source, run
        self.ahead: queue.Queue = queue.Queue(maxsize=self.AHEAD)
        self.thread = threading.Thread(target=self._fill, daemon=True)
        self.thread.start()

    def _fill(self) -> None:
        try:
            while not self.run.stop.is_set():
                try:
                    entry, offset = self.work.get_nowait()
                except queue.Empty:
                    return
                fd, problem = copiers.open_source(self.source, entry, offset)
                if problem is not None:
                    self.run.fail(entry[0], *problem)
                    continue
                self.ahead.put((entry, offset, fd))
        except BaseException as e:  # the opener must never end quietly: files not handed out would not be copied
            self.run.abort(e)
        finally:
            self.ahead.put(None)

    def next(self):
        item = self.ahead.get()
        if item is None:
            self.ahead.put(None)  # for the other consumers
        return item

    def close(self) -> None:
        """Close the files opened ahead and never taken (after a fatal error), until the opener has stopped."""
        while True:
            try:
                item = self.ahead.get_nowait()
            except queue.Empty:
                if not self.thread.is_alive():
                    return
                self.thread.join(0.01)
                continue
            if item is not None:
                os.close(item[2])


def _push_sender(ch: Channel, work: queue.SimpleQueue, source: Source, run: _Run, inflight: dict) -> None:
    files = _Prefetch(work, source, run)
    ch.doing = "put"
    ch.flush_sent = False
    try:
        while not run.stop.is_set():
            item = files.next()
            if item is None:
                break
            (path, size, mtime, digest, mode), offset, fd = item
            try:
                inflight[path] = offset
                hdr = {"op": "put", "path": path, "size": size, "mtime_ns": mtime, "hash": digest, "mode": mode}
                send(ch.w, {**hdr, "offset": offset, "n": size - offset})
                pos = pump(fd, offset, size, ch.w.write, run.bucket, run.sent_bytes)
                if pos < size:  # the file shrank: pad to keep the stream in step; the agent's hash check rejects it
                    ch.w.write(bytes(size - pos))
            finally:
                os.close(fd)
        send(ch.w, {"op": "flush"})
        ch.flush_sent = True
        ch.w.flush()
    except OSError:
        run.abort(ch.broken("the connection broke while sending"))
    finally:
        files.close()


def _push_receiver(ch: Channel, run: _Run, inflight: dict) -> None:
    """The acks of one push stream, until its flush reply. Whatever ends it early (a broken connection, a
    protocol violation, anything unexpected) ends the stage: ssh is stopped, so the sender stops too."""
    try:
        while True:
            flushing = ch.flush_sent  # the agent may beat while it flushes, never before the flush is sent
            ch.doing = "put" if inflight or not flushing else "flush"  # what a stall message names
            try:
                msg = ch.recv(beats=lambda: ch.flush_sent)  # asked when a beat comes: the sender may flush meanwhile
                path, error = check_ack(msg, inflight)
            except ProtocolError as e:
                raise ch.violation(str(e)) from None
            if path == "" and error is None:  # flushed
                return
            if path is not None:
                offset = inflight.pop(path)
            if error is not None:
                run.fail(path, *error)
                if path is None:
                    ch.kill()
                    return
            else:
                run.ok(offset > 0)
    except BaseException as e:  # never a silent thread death: the stage ends with it
        _receiver_ended(ch, run, e, "receiving acknowledgements")
    ch.kill()  # an early end: the sender (blocked on a full pipe, perhaps) must stop too


def _receiver_ended(ch: Channel, run: _Run, e: BaseException, doing: str) -> None:
    """What ended a receiver thread early becomes the stage's error: a broken connection (unless the stage
    was stopping anyway), hpcscale's own errors as they are, anything else as unexpected."""
    if isinstance(e, OSError | EOFError):
        if not run.stop.is_set():
            run.abort(ch.broken(f"the connection broke while {doing}"))
    elif isinstance(e, RuntimeFailure | VerificationFailure | BadInput):
        run.abort(e)
    else:
        run.abort(RuntimeFailure(f"{ch.ep}: unexpected {type(e).__name__} while {doing}: {e}"))


def _pull(entries, dirs, manifest_text, src: Endpoint, sink: Sink, opts: StageOptions, run: _Run, early) -> None:
    todo = _apply_plan(entries, sink.plan(entries, opts.check, _sha256(manifest_text), dirs=dirs), run)
    if opts.dry_run:
        return
    if todo:
        n = max(1, min(opts.jobs, len(todo)))
        per_stream = opts.bwlimit / n if opts.bwlimit else None
        channels = []
        ch0 = _take(early)
        if ch0 is not None:
            try:
                ch0.init({"bwlimit": per_stream})
            except BaseException:
                ch0.close()
                raise
            channels.append(ch0)
        try:
            channels += _open_channels(src, "source", {"bwlimit": per_stream}, opts, n - len(channels))
        except BaseException:
            for ch in channels:
                ch.close()
            raise
        run.result.streams = len(channels)
        try:
            work: queue.SimpleQueue = queue.SimpleQueue()
            for item in todo:
                work.put(item)
            threads = []
            for ch in channels:
                pending: queue.SimpleQueue = queue.SimpleQueue()
                window = threading.Semaphore(WINDOW)
                threads.append(threading.Thread(target=_pull_sender, args=(ch, work, run, pending, window)))
                threads.append(threading.Thread(target=_pull_receiver, args=(ch, sink, run, pending, window)))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for ch in channels:
                ch.close()
    _commit(sink, manifest_text, run, len(todo))


def _pull_sender(ch: Channel, work: queue.SimpleQueue, run: _Run, pending: queue.SimpleQueue, window):
    ch.doing = "get"
    try:
        while not run.stop.is_set():
            try:
                item = work.get_nowait()
            except queue.Empty:
                break
            if not window.acquire(blocking=False):
                ch.w.flush()  # requests go out in groups: one ssh packet per window, not per file
                while not window.acquire(timeout=0.1):  # a receiver that ended stops the run: never wait on
                    if run.stop.is_set():
                        break
            if run.stop.is_set():
                break
            pending.put(item)
            entry, offset = item
            # the size: the agent refuses a file of another size rather than send bytes we would not take
            send(ch.w, {"op": "get", "path": entry[0], "offset": offset, "size": entry[1]})
        ch.w.flush()
    except OSError:
        run.abort(ch.broken("the connection broke while sending requests"))
    finally:
        pending.put(None)  # tells the receiver that no more requests come


def _pull_receiver(ch: Channel, sink: Sink, run: _Run, pending: queue.SimpleQueue, window) -> None:
    """The replies of one pull stream, one per get in `pending`. Whatever ends it early (a broken connection,
    a protocol violation, anything unexpected) ends the stage at once: the run is aborted and ssh stopped, so
    the sender, waiting on the window or on a full pipe, stops too."""
    try:
        while True:
            item = pending.get()
            if item is None:
                return
            try:
                _pull_one(ch, sink, run, *item)
            finally:
                window.release()
    except BaseException as e:  # never a silent thread death: the stage ends with it
        _receiver_ended(ch, run, e, "receiving")
    ch.kill()


def _pull_one(ch: Channel, sink: Sink, run: _Run, entry: list, offset: int) -> None:
    """One get's reply and its bytes into the sink (a file that fails is failed, the stream goes on)."""
    try:
        error = check_get(ch.recv(), entry, offset)
    except ProtocolError as e:
        raise ch.violation(str(e)) from None
    if error is not None:
        run.fail(entry[0], *error)
        return
    left = entry[1] - offset  # exactly what check_get let through: never more than the manifest's size
    try:
        w = sink.begin(entry, offset)
    except (StageError, OSError) as e:
        run.fail(entry[0], str(e), getattr(e, "kind", "runtime"))
        w = None
    except Exception as e:
        run.fail(entry[0], f"unexpected {type(e).__name__}: {e}", "runtime")
        w = None
    while left:
        data = ch.r.read(min(BLOCK, left))
        if not data:
            if w is not None:
                w.abort()
            raise EOFError
        left -= len(data)
        run.sent_bytes(len(data))
        if w is not None:
            try:
                w.write(data)
            except OSError as e:  # a local write failed (disk full): this file fails, the stream stays in step
                w.abort()
                w = None
                run.fail(entry[0], str(e), "runtime")
    if w is not None:
        try:
            w.finish()
            run.ok(offset > 0)
        except (StageError, OSError) as e:
            run.fail(entry[0], str(e), getattr(e, "kind", "runtime"))
        except Exception as e:
            run.fail(entry[0], f"unexpected {type(e).__name__}: {e}", "runtime")


def stage_files(
    manifest: Manifest, src: str, dst: str, *, opts: StageOptions | None = None, progress: Progress | None = None
) -> StageResult:
    """Library entry point (cross-site rounds): stage `manifest`'s files from `src` to `dst` (paths or URLs)."""
    text = manifest_text(manifest)
    return stage(
        manifest,
        text,
        parse_endpoint(src, "source"),
        parse_endpoint(dst, "destination"),
        opts or StageOptions(),
        progress,
    )
