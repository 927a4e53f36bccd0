"""Two small thread helpers for work that releases the GIL (reads, hashes, lstats, file creation).

Invariant: an exception on a worker thread is never lost; it is re-raised in the caller that waits.
"""

import threading


def parallel_map(fn, items, jobs, batch=32):
    """[fn(x) for x in items] on `jobs` threads, each taking runs of `batch` neighbouring items (so reads stay
    near-sequential) from a shared cursor; the first exception is re-raised. Lighter than an executor's
    future per item, which costs more than hashing a small file."""
    items = list(items)
    out = [None] * len(items)
    jobs = max(1, min(jobs, (len(items) + batch - 1) // batch))
    if jobs == 1:
        return [fn(x) for x in items]
    lock = threading.Lock()
    cursor = [0]
    errors = []

    def work():
        while not errors:
            with lock:
                start = cursor[0]
                cursor[0] += batch
            if start >= len(items):
                return
            for j in range(start, min(start + batch, len(items))):
                try:
                    out[j] = fn(items[j])
                except BaseException as e:
                    errors.append(e)
                    return

    threads = [threading.Thread(target=work, daemon=True) for _ in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def in_background(fn, *args):
    """Start fn(*args) on a thread; returns a function that waits for it and returns its result (or raises)."""
    box = []

    def run():
        try:
            box.append((True, fn(*args)))
        except BaseException as e:
            box.append((False, e))

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def result():
        t.join()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    return result
