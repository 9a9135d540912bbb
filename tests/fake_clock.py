"""A clock the progress tests move by hand (``clock.now += 1``), patched in where the code reads its time."""


class FakeClock:
    """Returns ``now`` when called, as ``time.monotonic`` would; starts at 0."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
