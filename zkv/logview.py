"""``zkv logs``: merge the JSON-lines logs of every process of a run by time, filter, follow.

Each ``*.jsonl`` file of the directory is time-ordered (one writer per file), so the
files are heap-merged by ``ts`` in O(n log f) for n lines and f files, streaming (a
file is never loaded whole). A line that is not a JSON object is shown as
``MALFORMED file:line`` and never stops the viewer; it sorts with the line before it
in its file. ``-f`` keeps polling every file (and new files) for complete new lines.

Pretty format, one line per event::

    12:03:04.567  INFO   worker[1]      worker.batch_done  seq=7 num_blocks=16 dur_ms=0.8
"""

from __future__ import annotations

import argparse
import glob
import heapq
import os
import sys
import threading
import time
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import orjson

from zkv import streams
from zkv.argtypes import nonneg_int, nonneg_ints, positive_float

DEFAULT_POLL_S = 0.25
_LEVEL_NUM = {"debug": 10, "info": 20, "warn": 30, "warning": 30, "error": 40,
              "exception": 40, "critical": 50, "fatal": 50}
_LEVEL_SHORT = {10: "DEBUG", 20: "INFO", 30: "WARN", 40: "ERROR", 50: "CRIT"}
_HEADER_KEYS = frozenset(("ts", "level", "event", "component", "rank", "pid", "exception"))
_MAX_RAW = 300


@dataclass(slots=True)
class Record:
    """One line of one file. ``data`` is None for a malformed line, whose ``ts`` is the
    previous good line's (so it keeps its place in the merge)."""

    ts: float
    source: str
    lineno: int
    raw: str
    data: dict[str, Any] | None

    @property
    def malformed(self) -> bool:
        return self.data is None


def parse_line(line: bytes, source: str, lineno: int, prev_ts: float) -> Record:
    raw = line.decode("utf-8", errors="replace")
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError:
        return Record(prev_ts, source, lineno, raw, None)
    if not isinstance(data, dict):
        return Record(prev_ts, source, lineno, raw, None)
    ts = data.get("ts")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return Record(prev_ts, source, lineno, raw, None)
    return Record(float(ts), source, lineno, raw, data)


def level_num(level: object) -> int:
    return _LEVEL_NUM.get(str(level).lower(), 20)


@dataclass(slots=True)
class Filters:
    """Conjunction of the given filters. A malformed line passes ``min_level`` (it counts
    as an error) and fails the others, which it cannot be checked against."""

    ranks: frozenset[int] | None = None
    seq: int | None = None
    min_level: str | None = None
    event: str | None = None

    def match(self, rec: Record) -> bool:
        data = rec.data
        if data is None:
            return self.ranks is None and self.seq is None and self.event is None
        if self.min_level is not None and level_num(data.get("level")) < level_num(self.min_level):
            return False
        if self.ranks is not None and _as_int(data.get("rank")) not in self.ranks:
            return False
        if self.seq is not None and _as_int(data.get("seq")) != self.seq:
            return False
        return self.event is None or self.event.lower() in str(data.get("event", "")).lower()


def _as_int(v: object) -> int | None:
    if isinstance(v, bool):
        return None
    try:
        return int(v)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


#: How long a file renamed away (rotated) is still read after a new one took its name: a
#: zkv process notices the rename within a second and writes to the old file until then.
ROTATED_GRACE_S = 5.0
#: Bytes of the last line read that are checked before each read (a copytruncate seen
#: even when the file grew past the old offset again in between).
TAIL_CHECK = 64


class Tail:
    """Reads one file from where it last stopped. A truncated file restarts at 0 (also one
    that grew past the old offset again before the next read, seen by the bytes before
    the offset: they are no longer the last line read); a file
    renamed away (logrotate's ``create``) or deleted is read to its end, for
    ``ROTATED_GRACE_S``, then closed (a deleted one was held open, its space with it, for as
    long as ``zkv logs -f`` ran), while the new file at the path is read from 0 (was: the
    lines written to the old file after the last poll were lost, and a longer new file was
    read from the old offset, mid-line)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.source = os.path.basename(path)
        self.offset = 0
        self.lineno = 0
        self.last_ts = 0.0
        self._f: Any = None  # the open file, and its (device, inode)
        self._id: tuple[int, int] | None = None
        self._old: list[tuple[Any, float, int, int]] = []  # renamed away: (f, until, offset, n)
        self._last = b""  # the end of the last line read from ``_f`` (up to TAIL_CHECK bytes)

    @property
    def idle(self) -> bool:
        """No file open: its path was missing at the last read and the grace is over."""
        return self._f is None and not self._old

    def close(self) -> None:
        for f, *_ in self._old:
            f.close()
        self._old = []
        if self._f is not None:
            self._f.close()
            self._f = None

    def records(self, final: bool) -> Iterator[Record]:
        """New lines since the last call. ``final=False`` leaves an unterminated last
        line (a writer mid-line) for the next call; ``final=True`` takes it too."""
        yield from self._rotated(final)
        try:
            st = os.stat(self.path)
        except OSError:  # deleted (or rotated away, none new yet): read to its end, closed
            st = None
        if self._f is not None and (st is None or self._id != (st.st_dev, st.st_ino)):
            self._old.append((self._f, time.monotonic() + ROTATED_GRACE_S, self.offset,
                              self.lineno))
            self._f = None
            yield from self._rotated(final)
            self.offset = self.lineno = 0
            self._last = b""
        if st is None:
            return
        if self._f is None:
            try:
                self._f = open(self.path, "rb")  # noqa: SIM115 (kept open: see _rotated)
            except OSError:
                return
            fst = os.fstat(self._f.fileno())
            self._id = (fst.st_dev, fst.st_ino)
        if self._rewritten(self._f):  # truncated (copytruncate), maybe written again
            self.offset = self.lineno = 0
            self._last = b""
        self.offset, self.lineno = yield from self._read(self._f, self.offset, self.lineno,
                                                         final, current=True)

    def _rewritten(self, f: Any) -> bool:
        """The file is shorter than the offset, or the bytes before the offset are not
        the end of the last line read: truncated, and written past the offset again."""
        if os.fstat(f.fileno()).st_size < self.offset:
            return True
        n = len(self._last)
        return n > 0 and os.pread(f.fileno(), n, self.offset - n) != self._last

    def _rotated(self, final: bool) -> Iterator[Record]:
        """The rest of the files renamed away; closed once their grace ended, after a
        last read that takes a cut last line too (no writer will end it: it showed in
        ``zkv logs``, as malformed, and was lost to ``zkv logs -f``)."""
        keep = []
        for f, until, offset, lineno in self._old:
            over = time.monotonic() >= until
            offset, lineno = yield from self._read(f, offset, lineno, final or over)
            if not over:
                keep.append((f, until, offset, lineno))
            else:
                f.close()
        self._old = keep

    def _read(self, f: Any, offset: int, lineno: int, final: bool, current: bool = False
              ) -> Generator[Record, None, tuple[int, int]]:
        f.seek(offset)
        while line := f.readline():
            if not line.endswith(b"\n") and not final:
                break
            offset += len(line)
            lineno += 1
            if current:
                self._last = line[-TAIL_CHECK:]
            line = line.rstrip(b"\r\n")
            if not line.strip():
                continue
            rec = parse_line(line, self.source, lineno, self.last_ts)
            self.last_ts = rec.ts
            yield rec
        return offset, lineno


def log_files(path: str, rotated: bool = False) -> list[str]:
    """``path`` itself if it is a file, else its ``*.jsonl`` files (``rotated``: and the
    plain ``*.jsonl.N`` files logrotate left), sorted by name."""
    if os.path.isfile(path):
        return [path]
    found = glob.glob(os.path.join(glob.escape(path), "*.jsonl"))
    if rotated:
        found += [p for p in glob.glob(os.path.join(glob.escape(path), "*.jsonl.*"))
                  if p.rsplit(".", 1)[1].isdigit()]
    return sorted(found)


def merge(tails: Iterable[Tail], final: bool) -> Iterator[Record]:
    """Heap-merge the new records of every tail by ``ts`` (ties keep file order)."""
    return heapq.merge(*(t.records(final) for t in tails), key=lambda r: r.ts)


def _printable(text: str) -> str:
    """``text``, or JSON-escaped when it holds a character a terminal would act on (an
    escape sequence, a bell: a field's value or a raw line may come from outside)."""
    return text if text.isprintable() else orjson.dumps(text).decode()


def _fmt_value(v: Any) -> str:
    if isinstance(v, str):
        if v and v.isprintable() and not any(c.isspace() or c in "\"'=" for c in v):
            return v
        return orjson.dumps(v).decode()
    if isinstance(v, float):
        return f"{v:.6g}"
    return orjson.dumps(v, default=str).decode()


def format_ts(ts: float) -> str:
    """Local ``HH:MM:SS.mmm``; a stamp no clock can show (1e300, inf) as it is written."""
    try:
        ms = int((ts - int(ts)) * 1000)
        return f"{time.strftime('%H:%M:%S', time.localtime(ts))}.{ms:03d}"
    except (OverflowError, OSError, ValueError):
        return repr(ts)


def format_record(rec: Record) -> str:
    """``HH:MM:SS.mmm  LEVEL  component[rank]  event  k=v ...`` (+ an indented traceback)."""
    data = rec.data
    if data is None:
        raw = rec.raw if len(rec.raw) <= _MAX_RAW else rec.raw[:_MAX_RAW] + "..."
        return f"--:--:--.---  MALFORMED  {_printable(rec.source)}:{rec.lineno}  {_printable(raw)}"
    who = str(data.get("component", "?"))
    if data.get("rank") is not None:
        who += f"[{data['rank']}]"
    level = _LEVEL_SHORT.get(level_num(data.get("level")), "INFO")
    kv = " ".join(f"{_printable(k)}={_fmt_value(v)}" for k, v in data.items()
                  if k not in _HEADER_KEYS)
    line = (f"{format_ts(rec.ts)}  {level:<5}  {_printable(who):<14} "
            f"{_printable(str(data.get('event', '?')))}")
    if kv:
        line += f"  {kv}"
    exc = data.get("exception")
    if exc:
        line += "\n" + "\n".join("    " + _printable(x) for x in str(exc).rstrip().splitlines())
    return line


def format_day(ts: float) -> str | None:
    """The local date line printed before the first line of each day (lines show only
    the time: a run that lasts weeks has many 03:12); None for a stamp no clock shows."""
    try:
        return f"-- {time.strftime('%Y-%m-%d %a', time.localtime(ts))} --"
    except (OverflowError, OSError, ValueError):
        return None


def _emit(records: Iterable[Record], filters: Filters, out: TextIO, as_json: bool,
          err: TextIO, shown: dict[str, str] | None = None) -> int:
    """Print the records that match; ``shown["day"]``: the last date line printed (kept
    by the caller across calls: a follow prints one when the day changes)."""
    shown = {} if shown is None else shown
    n = 0
    for rec in records:
        if not filters.match(rec):
            continue
        if as_json and rec.malformed:
            print(f"zkv logs: malformed line {rec.source}:{rec.lineno}: "
                  f"{_printable(rec.raw[:_MAX_RAW])}", file=err)
            n += 1  # (shown, on stderr: it matched)
            continue
        if not as_json and not rec.malformed:
            day = format_day(rec.ts)
            if day is not None and day != shown.get("day"):
                print(day, file=out)
                shown["day"] = day
        print(rec.raw if as_json else format_record(rec), file=out)
        n += 1
    return n


def _merged(path: str) -> Iterator[Record]:
    """Every line of ``path``'s logs (logrotate's ``*.jsonl.N`` too), merged by time, once."""
    tails = [Tail(p) for p in log_files(path, rotated=True)]
    try:
        yield from merge(tails, final=True)
    finally:
        for t in tails:
            t.close()


def view(path: str, filters: Filters | None = None, out: TextIO | None = None,
         as_json: bool = False) -> int:
    """Print the merged logs once; the number of lines printed."""
    return _emit(_merged(path), filters or Filters(), out or sys.stdout, as_json, sys.stderr)


def follow(path: str, filters: Filters | None = None, out: TextIO | None = None,
           as_json: bool = False, poll_s: float = DEFAULT_POLL_S,
           stop: threading.Event | None = None, err: TextIO | None = None) -> int:
    """Print what is there, then new lines of every file (and of new files) every
    ``poll_s`` until ``stop`` is set or Ctrl-C; the number of lines printed. Like
    ``tail -F``, a directory that does not exist yet (a run about to start) is waited
    for; one line on ``err`` says so."""
    out = out or sys.stdout
    err = err or sys.stderr
    filters = filters or Filters()
    stop = stop or threading.Event()
    poll_s = min(max(poll_s, 0.01), 5.0)
    tails: dict[str, Tail] = {}
    shown: dict[str, str] = {}
    n = 0
    told = False
    try:
        while True:
            found = log_files(path)
            for p in found:
                tails.setdefault(p, Tail(p))
            for p in set(tails).difference(found):
                if tails[p].idle:  # deleted, and read to its end (it held the file open)
                    del tails[p]
            if not tails and not told:
                what = ("*.jsonl log files in it" if os.path.isdir(path)
                        else "it to appear")
                print(f"zkv logs: {path}: waiting for {what} (Ctrl-C stops)", file=err,
                      flush=True)
                told = True
            n += _emit(merge([tails[p] for p in sorted(tails)], final=False), filters, out,
                       as_json, sys.stderr, shown)
            out.flush()
            if stop.wait(poll_s):
                return n
    except KeyboardInterrupt:
        return n
    finally:
        for t in tails.values():
            t.close()


def _no_match(path: str, filters: Filters) -> str:
    """The line for a view that printed nothing (status 0 still: an empty answer is one),
    so that a typo in ``--rank`` or ``--event`` does not read as a quiet run. With a rank
    filter, the ranks that did log (one more pass over the files; only in this case)."""
    line = f"{path}: no event matched"
    if filters.ranks is None:
        return line
    ranks: set[int] = set()
    for rec in _merged(path):
        r = _as_int(rec.data.get("rank")) if rec.data is not None else None
        if r is not None:
            ranks.add(r)
    logged = ", ".join(map(str, sorted(ranks))) if ranks else "none"
    return f"{line} (ranks in these logs: {logged})"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="log directory of a run (or one .jsonl file)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    # one word a flag (R[,R...]), so "--rank 1 DIR" leaves DIR the directory
    p.add_argument("--rank", type=nonneg_ints, action="extend", default=None,
                   metavar="R[,R...]",
                   help="only events of these ranks (again for more: --rank 0 --rank 2)")
    p.add_argument("--seq", type=nonneg_int, default=None, metavar="N",
                   help="only events of batch N")
    p.add_argument("--level", default=None, type=str.lower,
                   choices=["debug", "info", "warn", "warning", "error", "critical"],
                   help="minimum level")
    p.add_argument("--event", default=None, metavar="SUBSTR",
                   help="only events whose name contains SUBSTR (case-insensitive)")
    p.add_argument("--json", action="store_true", help="print the raw JSON lines")
    p.add_argument("--poll-s", type=positive_float, default=DEFAULT_POLL_S, help=argparse.SUPPRESS)


def _tolerant_streams() -> None:
    """A character the terminal's encoding lacks (a U+FFFD standing for a garbled byte,
    under a Latin-1 locale) is written as an escape, not a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (OSError, ValueError):
                pass


def run_args(ns: argparse.Namespace) -> int:
    _tolerant_streams()
    filters = Filters(ranks=frozenset(ns.rank) if ns.rank else None, seq=ns.seq,
                      min_level=ns.level, event=ns.event)
    try:
        if ns.follow:
            follow(ns.dir, filters, as_json=ns.json, poll_s=ns.poll_s)
            return 0
        if not os.path.exists(ns.dir):
            print(f"zkv logs: {ns.dir}: no such file or directory", file=sys.stderr)
            return 1
        if not log_files(ns.dir):
            print(f"zkv logs: {ns.dir}: no *.jsonl log files in it", file=sys.stderr)
            return 1
        if not view(ns.dir, filters, as_json=ns.json):
            print(f"zkv logs: {_no_match(ns.dir, filters)}", file=sys.stderr)
        sys.stdout.flush()
    except BrokenPipeError:  # `zkv logs DIR | head`
        streams.silence(sys.stdout)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zkv logs", description="Merge and follow zkv logs.")
    add_arguments(p)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
