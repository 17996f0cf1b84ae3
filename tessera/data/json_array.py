"""A .json file that holds one JSON array (a common export: `json.dump(list_of_rows, f)`), read one element at a
time: the file is scanned in chunks for the commas and the closing bracket at the array's own level, and each
element is parsed alone, so memory holds one element (and one chunk), not the file, and a broken element is one bad
record, not a broken file. No third-party streaming parser (ijson) is needed.

Limits: an element's brackets are counted, not matched by kind; one whose brackets do not balance (say `{"a": [}`)
is read as running on to the next balanced point, which may take the rest of the file into memory and into that one
bad record. Such a file is not JSON; each element of a well-formed array is read exactly. A bad element is named by
the line it starts on and its number; the columns of its reason count from the element's first character.
"""

import re
from collections.abc import Iterator
from typing import BinaryIO

_CHUNK = 1 << 20
_WHITESPACE = b" \t\r\n"
BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which a text file may start with
_STRUCTURE = re.compile(rb'[\[\]{}",]')  # outside strings: what may end an element
_STRING_REST = re.compile(rb'(?:[^"\\]++|\\.)*+"', re.DOTALL)  # inside a string: the rest of it, to its end


def is_array(f: BinaryIO) -> bool:
    """Whether the file's first byte after whitespace (and a UTF-8 byte-order mark) is '['. Leaves `f` at 0."""
    f.seek(0)
    head = f.read(len(BOM))
    head = head[len(BOM):] if head == BOM else head
    while head is not None:
        rest = head.lstrip(_WHITESPACE)
        if rest:
            f.seek(0)
            return rest[:1] == b"["
        head = f.read(_CHUNK) or None
    f.seek(0)
    return False


def elements(f: BinaryIO) -> Iterator[tuple[str, bytes | None, int, str | None]]:
    """(where, raw bytes, file offset after it, problem) of each element, in order. `where` is 'line L (element K)',
    L the line it starts on. A problem (raw None) is a part of the file that is no element: what follows the
    closing bracket, or an array cut short."""
    buf, base = bytearray(f.read(_CHUNK)), 0  # buf holds the file from offset `base`
    while b"[" not in buf:  # is_array said there is one, after whitespace
        buf += f.read(_CHUNK)
    i = buf.index(b"[") + 1  # where to scan on
    line, counted = 1 + buf.count(b"\n", 0, i), i  # the line of byte `counted`
    start, depth, in_string, k = i, 0, False, 0  # start: where the current element begins
    while True:
        m = _STRING_REST.match(buf, i) if in_string else _STRUCTURE.search(buf, i)
        if m is None:  # the string, or the element, goes on past the bytes read
            more = f.read(max(_CHUNK, len(buf)))  # doubling: a long string is scanned again O(1) times per byte
            if not more:
                break
            line += buf.count(b"\n", counted, start)
            i = (i if in_string else len(buf)) - start
            del buf[:start]
            base, counted, start = base + start, 0, 0
            buf += more
            continue
        if in_string:
            i, in_string = m.end(), False
            continue
        c, i = buf[m.start()], m.end()
        if c == 0x22:  # "
            in_string = True
        elif c in b"[{":
            depth += 1
        elif c in b"]}" and depth:
            depth -= 1
        elif depth == 0 and c in b",]":  # the end of an element, or of the array
            raw = bytes(buf[start:m.start()])
            if raw.strip(_WHITESPACE) or c == 0x2C:  # '[]' and a trailing comma hold no element
                k += 1
                skipped = len(raw) - len(raw.lstrip(_WHITESPACE))
                line += buf.count(b"\n", counted, start + skipped)
                counted = start + skipped
                yield f"line {line} (element {k})", raw[skipped:], base + m.start(), None
            start = i
            if c == 0x5D:  # ]
                yield from _after_array(f, bytes(buf[i:]), base + i, line + buf.count(b"\n", counted, i))
                return
    raw = bytes(buf[start:])
    line += buf.count(b"\n", counted, start + len(raw) - len(raw.lstrip(_WHITESPACE)))
    where = f"line {line} (element {k + 1})"
    yield where, None, base + len(buf), ("the file ends inside this element, before the array's closing ']' (cut "
                                         "short?)" if raw.strip(_WHITESPACE) else "the file ends before the array's "
                                                                                   "closing ']' (cut short?)")


def _after_array(f: BinaryIO, tail: bytes, offset: int, line: int) -> Iterator[tuple]:
    """Only whitespace may follow the array; anything else is named once, by the line it starts on."""
    while tail:
        rest = tail.lstrip(_WHITESPACE)
        if rest:
            line += tail[:len(tail) - len(rest)].count(b"\n")
            yield (f"line {line} (after the array)", None, offset + len(tail) - len(rest),
                   "more data after the array's closing ']': a .json file holds one array, or one JSON object per line")
            return
        line, offset, tail = line + tail.count(b"\n"), offset + len(tail), f.read(_CHUNK)
