"""Run a function in n threads, as the drafter replicas run."""
import threading


def in_threads(fn, n: int, timeout: float = 60) -> list:
    """fn(r) for r < n, each in its own thread (as the replicas run); their results; any exception fails."""
    out, errors = [None] * n, []

    def work(r):
        try:
            out[r] = fn(r)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    return out
