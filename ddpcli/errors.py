"""The one exception type users see: a message and the exit code it ends with."""

import os
import re

USAGE = 2  # bad flag value, unreadable recipe, missing data, unknown GPU or interface
RUNTIME = 1  # a rank died, a timeout, a collective failed
INTERRUPTED = 130  # Ctrl-C, as a shell reports a command SIGINT ended (128 + 2)


class DdpcliError(Exception):
    """An error meant for the user: the CLI prints `message` (no traceback) and exits."""

    def __init__(
        self,
        message: str,
        exit_code: int = USAGE,
        every_rank: bool = False,
        data: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        # Found from values every rank shares (a reduced loss, the data set's size): said
        # once for all of them.
        self.every_rank = every_rank
        # What --json says beside the message (the collective verdict: ddpcli.collectives).
        self.data = data

    def document(self) -> dict:
        """The failure as data: what --json prints and summary.json holds."""
        return {"failed": self.message, "exit_code": self.exit_code, **(self.data or {})}


def usage_error(message: str) -> DdpcliError:
    return DdpcliError(message, USAGE)


def runtime_error(message: str) -> DdpcliError:
    return DdpcliError(message, RUNTIME)


def agreed_error(message: str, exit_code: int = RUNTIME) -> DdpcliError:
    """A stop every rank reaches alike, from the same values (a reduced loss, the data set's
    size): said once for all of them."""
    return DdpcliError(message, exit_code, every_rank=True)


# What a rank's error says when another rank died or hung: its failure is a consequence.
PEER_LOST = ("closed by peer", "reset by peer", "Broken pipe", "remote process exited")


# What a rank's error says when it gave up waiting at a collective.
TIMED_OUT = ("Timed out", "timed out", "Timeout", "timeout")


# A survivor's word when the agent stopped it because another rank failed
# (ddpcli.training.stopping), followed by where it was: " while waiting at PLACE" (in a
# collective) or " while busy at PLACE".
STOPPED_FOR_PEER = "stopped because another rank failed"


def lost_a_peer(error_text: str) -> bool:
    return any(marker in error_text for marker in PEER_LOST)


# gloo's errors begin with where in its C++ they were raised.
BACKEND_PREFIX = re.compile(r"\[[^\]]+\.(cc|cpp|h):\d+\] ")


def from_the_backend(error: BaseException) -> bool:
    """Raised by torch.distributed's C++ side: a Dist*Error, gloo's [file.cc:561] prefix, or
    the words gloo closes a timed-out pair with, which have none."""
    text = str(error)
    named = type(error).__name__.startswith("Dist") or "caused pair closure" in text
    return named or bool(BACKEND_PREFIX.match(text))


def gave_up_waiting(error: BaseException) -> bool:
    """A collective timed out: the rank waited for another one that never came."""
    return from_the_backend(error) and any(marker in str(error) for marker in TIMED_OUT)


def backend_gist(error: BaseException) -> str:
    """ "Connection closed by peer [10.0.0.2]:4803" out of gloo's or NCCL's long first line."""
    line = BACKEND_PREFIX.sub("", first_line(error), count=1)
    return line.split(". ")[0].rstrip(".")


def said_by_rank(rank: int, message: str) -> str:
    """A worker's line names its rank once: many messages already begin with it."""
    return message if message.startswith("rank ") else f"rank {rank}: {message}"


def first_line(error: BaseException, limit: int = 300) -> str:
    """An exception in one line for a message: its first line, or its type if it says nothing."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:limit]


def debug_requested(flag: bool = False) -> bool:
    """--debug or DDPCLI_DEBUG=1: show tracebacks instead of one line."""
    return flag or os.environ.get("DDPCLI_DEBUG", "") not in ("", "0")
