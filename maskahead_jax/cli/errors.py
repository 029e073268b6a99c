"""Exit statuses and one-line errors: every subcommand fails the same way (`maskahead --help`)."""
from __future__ import annotations

# One exit-status convention for every subcommand (docs/evaluation.md, `maskahead --help`).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_STATUS = """\
exit status (every subcommand):
  0    ok
  1    a run failed (an eval run / profile case errored mid-way: the others' results are kept,
       the error is in summary.json / the JSON); also an I/O error such as a full disk
  2    bad input or usage: one line `maskahead <cmd>: error: <message>` on stderr, checked before
       any model is loaded or any forward runs (options, policies, knobs, --out, model folder, data)
  130  interrupted (Ctrl-C); an interrupted eval resumes when the same command is rerun
MASKAHEAD_TRACEBACK=1 shows the full traceback instead of the one-line error."""


class CLIError(Exception):
    pass




def one_line(text: str, limit: int = 500) -> str:
    """The first non-empty line, cut at `limit` characters (a foreign error's page-long line)."""
    lines = [x.strip() for x in str(text).splitlines() if x.strip()]
    first = lines[0] if lines else ""
    if len(first) > limit:
        first = first[:limit] + " ..."
    return first


# ours carry paths (a hub cache: ~520 characters in the tests), so they get a little more room
OWN_LIMIT = 600
_PLAIN = (ValueError, OSError, FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError)


def describe_error(e: BaseException) -> str:
    """One line for an error: this project's own errors by their message (written to be read);
    a foreign one (orbax, tensorstore, json, ...) by its root cause; the type is named unless it
    is one whose message reads on its own (ValueError, OSError and the like)."""
    if isinstance(e, CLIError) or type(e).__module__.split(".")[0] in ("maskahead_jax", "converters"):
        return one_line(str(e), OWN_LIMIT) or type(e).__name__
    seen = {id(e)}
    while True:
        nxt = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(nxt))
        e = nxt
    text = one_line(str(e))
    if text and type(e) in _PLAIN:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
