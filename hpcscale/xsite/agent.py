"""The staging agent: what `ssh HOST python3 -c BOOT` runs at the other site, serving one stream (`main`).

hpcscale/xsite/bootstrap.py sends this module and the hpcscale.portable modules it imports over the ssh
connection, and the remote `python3 -S` installs them under their own names and calls `main`; so another site
needs nothing installed but python3 >= 3.8 (and the `xxhash` or `blake3` module for those algorithms; sha256
is in the standard library). Hence, as for hpcscale.portable: standard library only, no hpcscale import
outside hpcscale.portable, nothing newer than Python 3.8.

What it serves (docs/staging.md): role 'sink' plans, receives and commits files into a destination root
(hpcscale.portable.sink.Sink), role 'source' sends files from a root (hpcscale.portable.source.Source), both
over the wire protocol of hpcscale.portable.wire. Every error becomes a reply carrying its kind; only a
stream that can no longer stay in step (Desync, EOF, a frame that breaks the protocol: WireError) ends the
agent, and a rerun resumes. Requests are read under the wire's bounds (REQUEST_MAX bytes a header, bounded
JSON, an object) and every field is type-checked before it is used: nothing the other side sends ends in a
traceback. While a plan, flush or commit works (a plan with --check hash may hash for hours), the agent sends
{"busy": OP} every `beat_s` seconds (init's option; BEAT_S without it), so that the local side's stall
timeout (hpcscale.xsite.channel) counts only silence, never work.
"""

import os
import sys
import threading
import time

from hpcscale.portable.errors import StageError
from hpcscale.portable.hashing import BLOCK
from hpcscale.portable.sink import Sink
from hpcscale.portable.source import Source
from hpcscale.portable.threads import in_background
from hpcscale.portable.wire import (
    REQUEST_MAX,
    Input,
    TokenBucket,
    WireError,
    read_exact,
    recv,
    send,
    stream_file,
    widen_pipe,
)


def _open_end(role, root, opts):
    if role == "sink":
        return Sink(
            root,
            opts["algorithm"],
            dry_run=opts.get("dry_run", False),
            sync=opts.get("sync", False),
            jobs=opts.get("jobs", 4),
            umask=opts.get("umask", 0),
            lock=opts.get("lock"),
        )
    return Source(root)


def serve(role, root, inp, out):
    """The remote side of one ssh stream: hello at once (so the connection is up before the other side has
    even read its manifest), then 'init' with the options, then role 'sink': plan/put/flush/commit; role
    'source': get."""

    def reply(msg):
        """A reply of the main thread: the op it answers is over, so no beat for it may follow."""
        with BEAT_LOCK:
            BUSY[0] = None
            send(out, msg)

    reply({"hello": 1, "python": sys.version.split()[0]})
    out.flush()
    end = None
    bucket = None
    pool = None
    try:
        while True:
            try:
                req = recv(inp, REQUEST_MAX)
            except EOFError:
                break
            except WireError as e:  # out of step: say why, and end as at the end of the stream
                reply({"error": f"the request stream broke the protocol: {e}", "kind": "runtime"})
                break
            op = req.get("op")
            try:
                if type(op) is not str:
                    raise StageError(f"a request without an op ({str(op)[:40]})", "runtime")
                if op == "init":
                    opts = req.get("opts") or {}
                    if type(opts) is not dict:
                        raise StageError("init: opts must be an object", "runtime")
                    idle = _seconds(opts, "idle_s")
                    if idle is not None:
                        IDLE_LIMIT[0] = idle
                    beat = _seconds(opts, "beat_s")
                    if beat is not None:
                        BEAT[0] = beat
                    rate = _seconds(opts, "bwlimit")  # bytes/s: the same rule, a finite number > 0 or none
                    end = _open_end(role, root, opts)
                    if role == "sink" and not opts.get("lock"):  # a stream that will plan: read ahead for it
                        end.prefetch_record()
                    bucket = TokenBucket(rate) if rate else None
                    reply({"ready": True, "root": end.root})
                    continue
                if end is None:
                    raise StageError(f"'{op[:40]}' before 'init'", "runtime")
                if op in ("plan", "flush", "commit"):
                    BUSY[0] = op  # until its reply: the watcher tells the other side we are working
                if op == "plan":
                    # Whether the destination already holds this very commit, found beside the plan's lstats (it
                    # reads and hashes the destination's manifest). Meaningful only if the plan hashes nothing:
                    # then nothing the plan does changes it.
                    is_clean = None
                    if "manifest_sha256" in req:  # None: no manifest is written, and nothing to commit can be
                        is_clean = in_background(end.is_clean, req["manifest_sha256"], req.get("name", "manifest.json"))
                    name = req.get("name", "manifest.json")
                    plan = end.plan(
                        req["entries"], req.get("check", "stat"), req.get("manifest_sha256"), name, req.get("dirs")
                    )
                    clean = (
                        is_clean is not None
                        and plan.hashed == 0
                        and end.dirs_clean
                        and plan.up_to_date == len(plan.statuses)
                        and is_clean()
                    )
                    reply({"statuses": plan.statuses, "info": plan.info(), "clean": clean, "lock": end.lock_token})
                elif op == "put":
                    n = req.get("n")
                    if type(n) is not int or not 0 <= n < 1 << 63:  # how many bytes follow is unknown: the end
                        reply({"error": f"put: n {str(n)[:40]} is not a byte count", "kind": "runtime"})
                        break
                    if req.get("offset", 0) == 0 and n < POOL_MAX:
                        pool = pool or _WriterPool(end, out)
                        pool.submit(_entry(req), read_exact(inp, n))
                    else:
                        _serve_put(end, req, inp, out)
                elif op == "flush":
                    if pool is not None:
                        pool.drain()
                    end.flush()
                    reply({"flushed": True})
                elif op == "commit":
                    if pool is not None:
                        pool.drain()
                    end.commit(req.get("manifest"), req.get("name", "manifest.json"))
                    reply({"committed": True})
                elif op == "get":
                    _serve_get(end, req, out, bucket)
                elif op == "bye":
                    break
                else:
                    reply({"error": f"unknown op {op[:40]!r}", "kind": "runtime"})
            except StageError as e:
                reply({"error": str(e), "kind": e.kind, "path": req.get("path")})
            except OSError as e:
                reply({"error": f"{req.get('path') or root}: {e}", "kind": "runtime", "path": req.get("path")})
            except (Desync, EOFError):  # the stream is out of step: end the agent (a rerun resumes)
                raise
            except Exception as e:  # anything unexpected fails this request, loudly, and the stage with it
                reply(
                    {
                        "error": f"{req.get('path') or root}: {_unexpected(e)}",
                        "kind": "runtime",
                        "path": req.get("path"),
                    }
                )
            finally:
                BUSY[0] = None  # (an op that breaks out of the loop ends the stream: no reply to order after)
            # No flush here: replies wait in the buffer until the agent is about to block on input (Input), so
            # acks of 10k small files cost a few ssh packets, not 10k.
    except (Desync, EOFError):
        if pool is not None:
            pool.close()  # its writers finish first: nothing is placed after the lock is given back
        if role == "sink" and end is not None:
            end.close()  # give the destination lock back: this stream, and the stage, are over
        raise
    if pool is not None:
        pool.close()
    out.flush()
    if role == "sink" and end is not None:
        end.flush()
        end.close()


def _seconds(opts, key):
    """opts[key] if it is a finite number > 0, None if absent or null; anything else is refused."""
    value = opts.get(key)
    if value is None:
        return None
    if type(value) not in (int, float) or not 0 < value < float("inf"):
        raise StageError(f"init: {key} {str(value)[:40]} is not a number > 0", "runtime")
    return float(value)


def _entry(req):
    """The file entry of a 'put' request; hpcscale.portable.paths.check_entry (in Writer) checks every field."""
    return [req.get("path"), req.get("size"), req.get("mtime_ns"), req.get("hash"), req.get("mode")]


def _unexpected(e):
    return f"unexpected {type(e).__name__}: {e}"


def _serve_put(sink, req, inp, out):
    entry = _entry(req)
    left = req["n"]
    writer = None
    error = None
    try:
        writer = sink.begin(entry, req.get("offset", 0))
    except Exception as e:
        error = e
    while left:
        data = inp.read(min(BLOCK, left))
        if not data:
            if writer is not None:
                writer.abort()
            raise EOFError(f"the stream ended inside {entry[0]}")
        left -= len(data)
        if writer is not None and error is None:
            try:
                writer.write(data)
            except Exception as e:
                error = e
                writer.abort()
    if error is None:
        try:
            writer.finish()
        except Exception as e:
            error = e
    if error is not None:
        kind = getattr(error, "kind", "runtime")
        text = str(error) if isinstance(error, (StageError, OSError)) else _unexpected(error)
        send(out, {"path": entry[0], "error": text, "kind": kind})
    else:
        send(out, {"path": entry[0], "ok": True})


POOL_MAX = 1 << 20  # files below this are read off the stream whole and written by the pool


class _WriterPool:
    """Two threads that write small files while the main thread reads the next ones off the pipe: creating a
    file is system time that would otherwise stall the stream (both release the GIL). Replies go out in
    completion order; each names its file."""

    def __init__(self, sink, out, threads=2):
        import queue

        self.sink, self.out = sink, out
        self.q = queue.Queue(maxsize=64)
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def submit(self, entry, data):
        self.q.put((entry, data))

    def _run(self):
        while True:
            item = self.q.get()
            try:
                if item is None:
                    return
                entry, data = item
                try:
                    w = self.sink.begin(entry, 0)
                    try:
                        w.write(data)
                    except BaseException:
                        w.abort()
                        raise
                    w.finish()
                    msg = {"path": entry[0], "ok": True}
                except (StageError, OSError) as e:
                    msg = {"path": entry[0], "error": str(e), "kind": getattr(e, "kind", "runtime")}
                except Exception as e:  # never a silent thread death: the file fails, and the stage with it
                    msg = {"path": entry[0], "error": _unexpected(e), "kind": "runtime"}
                send(self.out, msg)  # one write call: BufferedWriter's own lock keeps replies whole
            finally:
                self.q.task_done()

    def drain(self):
        self.q.join()

    def close(self):
        for _ in self.threads:
            self.q.put(None)
        for t in self.threads:
            t.join()


class Desync(Exception):
    """The stream cannot continue (a file changed while being sent): the agent exits; a rerun resumes."""


def _serve_get(source, req, out, bucket):
    """The file, from `offset`, if it still has the `size` the request names (the manifest's): the other side
    takes exactly that many bytes, so a file of another size is refused here (kind 'verify'), nothing sent."""
    fd = source.open(req.get("path"))
    try:
        size = os.fstat(fd).st_size
        want = req.get("size")
        if want is not None and want != size:
            raise StageError(
                "{}: the source holds {} bytes, the manifest says {}".format(req["path"], size, str(want)[:40]),
                "verify",
            )
        offset = req.get("offset", 0)
        if type(offset) is not int or not 0 <= offset <= size:
            raise StageError(
                "{}: offset {} is not within its {} bytes".format(req["path"], str(offset)[:40], size), "input"
            )
        send(out, {"path": req["path"], "n": max(0, size - offset), "size": size})
        try:
            stream_file(fd, offset, size, out, bucket)
        except Exception as e:  # the header promised the bytes: whatever stops them, the stream is out of step
            raise Desync("{}: {}".format(req["path"], e)) from None
    finally:
        os.close(fd)


IDLE_S = 600.0  # waiting this long for the other side's next bytes: it is gone (init's "idle_s" overrides)


IDLE_LIMIT = [IDLE_S]  # a list: init may change it while the watcher runs

BEAT_S = 30.0  # while a plan, flush or commit works: {"busy": OP} this often (init's "beat_s" overrides)
BEAT = [BEAT_S]
BUSY = [None]  # the op being worked on (plan, flush, commit), None between requests
BEAT_LOCK = threading.Lock()  # a beat is sent only while BUSY holds the op: never after that op's reply


def _watch_idle(inp, limits, out=None):
    """End the agent when the other side has sent nothing for limits[0] seconds while the agent waits for it.

    A client that dies cleanly closes the connection and the agent reads EOF. One cut off by a broken link
    sends nothing at all, and without this the agent would sit in read() holding the destination lock until
    sshd noticed (hours, without ClientAliveInterval); every later stage into that destination would be
    refused. Exiting leaves the lock file with a dead holder, which the next stage on this host takes over
    (hpcscale.portable.lock). Time the agent spends working (a long plan) is not waiting, and does not count.

    The same thread tells the other side that the agent works: {"busy": OP} every BEAT[0] seconds of a plan,
    flush or commit (to `out`), which the other side's own stall timeout waits for."""
    beat_at = None
    while True:
        time.sleep(min(5.0, limits[0] / 4, BEAT[0] / 2))
        busy = BUSY[0]
        if busy is None or out is None:
            beat_at = None
        elif beat_at is None:
            beat_at = time.monotonic() + BEAT[0]
        elif time.monotonic() >= beat_at:
            beat_at = time.monotonic() + BEAT[0]
            try:
                with BEAT_LOCK:
                    if BUSY[0] is not None:
                        send(out, {"busy": BUSY[0]})  # one write: whole beside the replies of other threads
                out.flush()
            except (OSError, ValueError):  # the other side is gone (or the stream closed): EOF ends us
                pass
        since = inp.waiting_since
        if since is not None and time.monotonic() - since > limits[0]:
            sys.stderr.write(f"hpcscale agent: nothing from the other side for {limits[0]:.0f} s; exiting\n")
            sys.stderr.flush()
            os._exit(3)


def main(argv):
    """`python3 -c <bootstrap> ROLE ROOT`: serve one stream on stdin/stdout."""
    role, root = argv[1], argv[2]
    widen_pipe(0)
    widen_pipe(1)
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but the protocol on stdout
    # Reading the raw fd is safe: the bootstrap read exactly its blobs' bytes from it, unbuffered.
    inp = Input(sys.stdin.fileno(), out.flush)
    threading.Thread(target=_watch_idle, args=(inp, IDLE_LIMIT, out), daemon=True).start()
    serve(role, root, inp, out)
    out.flush()
    sys.stderr.flush()
    # serve() closed everything it opened; skip the interpreter's teardown, which the other side would wait for
    os._exit(0)
