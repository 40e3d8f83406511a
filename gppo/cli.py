"""The `gppo` command: dispatches to the modules of `gppo.commands` and answers every expected
error (a bad setting, a missing file, an invalid point of the design space) with one line
`gppo <command>: error: ...` and exit status 2. GPPO_DEBUG=1 shows the traceback instead.

SIGTERM (what SLURM and Kubernetes send before preemption) stops a command as Ctrl-C does: the
step in flight is dropped, the last checkpoint stays whole, the command says how to continue, and
the exit status is 143 (128 + SIGTERM; 130 for Ctrl-C)."""

from __future__ import annotations

import importlib
import os
import signal
import sys

from gppo.commands import COMMANDS
from gppo.core import closest

# ConfigError, GPPOConfigError and GPPOInputError are ValueErrors; OSError covers missing files,
# permissions and a full disk.
EXPECTED_ERRORS = (ValueError, OSError)


def describe(err: BaseException) -> str:
    """The message of an expected error (an OSError as 'reason: path')."""
    if isinstance(err, OSError) and err.strerror and err.filename:
        return f"{err.strerror}: {err.filename}"
    return str(err) or type(err).__name__


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that it unwinds like Ctrl-C's KeyboardInterrupt."""


def _raise_terminated(signum, frame):
    raise Terminated()


def run_command(name: str, argv: list[str]) -> int:
    """Parse `argv` with the command's parser and run it; every expected error is one line on stderr."""
    module = importlib.import_module(f"gppo.commands.{name}")
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return module.run(module.parser().parse(argv))
    except SystemExit as done:  # --help
        return done.code if isinstance(done.code, int) else 0
    except KeyboardInterrupt as stop:
        how = "stopped by SIGTERM" if isinstance(stop, Terminated) else "interrupted"
        print(f"gppo {name}: {how}{getattr(module, 'CONTINUE_HINT', '')}", file=sys.stderr)
        return 143 if isinstance(stop, Terminated) else 130
    except EXPECTED_ERRORS as err:
        if os.environ.get("GPPO_DEBUG"):
            raise
        print(f"gppo {name}: error: {describe(err)}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: gppo {"
            + ",".join(COMMANDS)
            + "} [options]\n\n"
            + "".join(f"  {name:<10} {text}\n" for name, text in COMMANDS.items())
        )
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(
            f"gppo: error: unknown command {command!r}{closest(command, COMMANDS)}; choose one of "
            f"{', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    return run_command(command, rest)


if __name__ == "__main__":
    sys.exit(main())
