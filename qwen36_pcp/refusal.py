# SPDX-License-Identifier: Apache-2.0
"""What the plugin refuses before an engine exists, and how a program that does not catch it ends.

A refused setup (a bad option, no GPU, an unsupported combination) is the user's to fix, and its
message says how: uncaught, it ends the program with that message alone on stderr and exit code 1,
not with two chained tracebacks through vLLM and pydantic that bury it (``excepthook``, installed by
``patches.install`` and removed by ``patches.uninstall``). ``VLLM_LOGGING_LEVEL=DEBUG`` keeps the
traceback. Every other exception reaches the hook that was there before, unchanged. vLLM-free, so
that the examples can use it before they import vLLM.
"""

from __future__ import annotations

import os
import sys


class Refusal(Exception):
    """A setup the plugin refuses before an engine exists; the message names the fix."""


class ConfigRefusal(Refusal, ValueError):
    """Options or engine arguments the plugin refuses (a ``ValueError``, as vLLM's own config errors)."""


class MachineRefusal(Refusal, RuntimeError):
    """A machine the plugin cannot run on as asked (no NVIDIA GPU, fewer GPUs than ranks)."""


def refusal_in(exc: BaseException | None) -> Refusal | None:
    """``exc`` itself if it is a refusal, or the refusal a pydantic ``ValidationError`` carries: vLLM's
    ``VllmConfig`` is a pydantic dataclass, so a ``ValueError`` raised by a config check (ours run
    there) reaches the caller wrapped, with the pydantic error listing around its message."""
    if isinstance(exc, Refusal):
        return exc
    errors = getattr(exc, "errors", None)
    if exc is None or type(exc).__name__ != "ValidationError" or not callable(errors):
        return None
    try:
        found = [e.get("ctx", {}).get("error") for e in errors()]
    except Exception:  # noqa: BLE001 - not pydantic's ValidationError after all
        return None
    refusals = [e for e in found if isinstance(e, Refusal)]
    return refusals[0] if len(refusals) == 1 and len(found) == 1 else None


_previous_hook = None  # the sys.excepthook ours passes everything else to
_active = False


def excepthook(exc_type, exc, tb) -> None:
    """``sys.excepthook`` for a refusal: its message alone (the interpreter then exits with 1)."""
    refusal = refusal_in(exc) if _active else None
    previous = _previous_hook or sys.__excepthook__
    if refusal is None or os.environ.get("VLLM_LOGGING_LEVEL", "").upper() == "DEBUG":
        return previous(exc_type, exc, tb)
    sys.stderr.write(f"{refusal}\n")
    sys.stderr.flush()


def install_excepthook() -> None:
    """Put ``excepthook`` in front of the current ``sys.excepthook`` (idempotent)."""
    global _previous_hook, _active
    _active = True
    if _previous_hook is None and sys.excepthook is not excepthook:
        _previous_hook = sys.excepthook
        sys.excepthook = excepthook


def uninstall_excepthook() -> None:
    """The hook from before ``install_excepthook`` back; if another hook has since been put in front of
    ours, ours stays in its chain and passes everything on."""
    global _previous_hook, _active
    _active = False
    if sys.excepthook is excepthook:
        sys.excepthook = _previous_hook or sys.__excepthook__
        _previous_hook = None
