"""How a trace gets closed when the job ends without rec.close(): SIGTERM (pre-emption: flush,
close, then die as the job would have) and the interpreter's exit (atexit; after an uncaught
error the interpreter has set sys.last_value, whose message becomes the trace's end reason)."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading


class ExitHooks:
    def __init__(self, close, on_error_leaving, handle_sigterm: bool):
        """``close(reason=...)`` closes the trace; ``on_error_leaving(exc, tb)`` records what
        an error ending the job says (out of memory: what held it)."""
        self._close, self._on_error_leaving = close, on_error_leaving
        self._prev_sigterm = None
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            try:
                self._prev_sigterm = signal.getsignal(signal.SIGTERM)
                signal.signal(signal.SIGTERM, self._on_sigterm)
            except (ValueError, OSError):  # not in the main interpreter thread, or no signals here
                self._prev_sigterm = None
        atexit.register(self._atexit)

    def _on_sigterm(self, signum, frame) -> None:
        self._close(reason="sigterm")
        prev = signal.SIG_DFL if self._prev_sigterm is None else self._prev_sigterm
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:  # default action: die by SIGTERM, as without us
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _atexit(self) -> None:
        # A job that dies of an uncaught error without `with Recorder(...)`: the interpreter has
        # set sys.last_value (3.12+: sys.last_exc) before it runs atexit handlers. Not in an
        # interactive session, where it may be an old error the session went on after.
        interactive = hasattr(sys, "ps1") or "IPython" in sys.modules
        exc = None if interactive else (getattr(sys, "last_exc", None) or getattr(sys, "last_value", None))
        if exc is not None:
            self._on_error_leaving(exc, exc.__traceback__)
        self._close(reason="exit" if exc is None else f"exception: {type(exc).__name__}: {exc}"[:1000])

    def remove(self) -> None:
        """The previous SIGTERM handler back (if ours is still the one set), and no atexit call."""
        if self._prev_sigterm is not None and threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._prev_sigterm)
        atexit.unregister(self._atexit)
