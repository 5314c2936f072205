#!/usr/bin/env python3
"""Build the bundled offline C4-format sample and its byte-level BPE tokenizer.

The sample lives in ``src/diloco/assets/sample/`` and mimics the ``allenai/c4`` ``en`` layout:

* ``c4-train.0000{0..3}-of-00004.json.gz`` and ``c4-validation.00000-of-00001.json.gz``: gzip JSON
  lines, one ``{"text", "timestamp", "url"}`` object per document;
* ``tokenizer/``: a byte-level BPE tokenizer (vocab 1024) trained on the train split only, with
  Mistral-7B's special-token ids (``<unk>``=0, ``<s>``=1, ``</s>``=2) and Mistral's conventions
  (BOS prepended, no EOS appended, pad = eos = ``</s>``);
* ``PROVENANCE.md``: sources, licences, how documents were cut, counts and the rebuild command.

All text is real English, public domain or permissively licensed, taken from Debian packages.
Nothing is fetched from the web: each package is read from its installed location when it is
installed, and otherwise fetched with ``apt-get download`` (Debian's package archive) and unpacked
with ``dpkg -x`` into a cache directory (never committed). Packages read: bible-kjv-text, bible-kjv,
r-cran-janeaustenr, dict-devil, jargon-text, display-dhammapada, wordnet-base, python3.11-doc and
sqlite3-doc (``apt-get install`` them to skip the downloads; their dependencies are not needed, except
libreadline8 for the ``bible`` program).

Rebuild (from the repository root)::

    apt-get update   # once, if the packages are not installed and apt has no lists yet
    .venv/bin/python src/diloco/assets/sample/build_sample.py

The output is deterministic for given package versions (they are recorded in PROVENANCE.md).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import math
import os
import random
import re
import shutil
import struct
import subprocess
import tempfile
import unicodedata
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[4]  # src/diloco/assets/sample/ -> the repository
DEFAULT_OUT = REPO_ROOT / "src" / "diloco" / "assets" / "sample"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "diloco-sample-sources"

TIMESTAMP = "2019-04-25T12:57:54Z"  # one fixed, C4-style timestamp for every document
SEED = 1234
VALIDATION_PER_MILLE = 50  # ~5% of documents go to validation (stable hash of the text)
NUM_TRAIN_FILES = 4
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 as in Mistral-7B's tokenizer
MODEL_MAX_LENGTH = 1_000_000
MIN_DOC_CHARS = 1000
MAX_DOC_CHARS = 3000
MEDIAN_DOC_CHARS = 1600
MIN_TAIL_CHARS = 250  # a last fragment shorter than this is merged into the previous doc or dropped
MAX_TOTAL_GZIP_BYTES = 10 * 1000 * 1000


# --------------------------------------------------------------------------------------------
# Debian packages
# --------------------------------------------------------------------------------------------


@dataclass
class Package:
    name: str
    version: str
    root: Path  # "/" when installed, else the directory the .deb was unpacked into
    origin: str  # "installed" or "apt-get download"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def get_package(name: str, probe: str, cache: Path) -> Package:
    """Return where package ``name`` is, with ``probe`` (a path inside it) readable.

    Uses the installed package when ``/probe`` exists and dpkg knows the package; otherwise downloads
    the .deb with ``apt-get download`` into ``cache`` and unpacks it with ``dpkg -x``.
    """
    installed = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status} ${Version}", name], capture_output=True, text=True
    )
    ok = installed.returncode == 0 and installed.stdout.startswith("install ok installed")
    if ok and (Path("/") / probe).exists():
        return Package(name, installed.stdout.split()[-1], Path("/"), "installed")
    dest = cache / name
    stamp = dest / ".version"
    if stamp.exists() and (dest / probe).exists():
        return Package(name, stamp.read_text().strip(), dest, "apt-get download")
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise SystemExit(f"package {name} is not installed and apt-get/dpkg are unavailable")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(["apt-get", "download", name], cwd=tmp, capture_output=True, text=True)
        debs = sorted(Path(tmp).glob(f"{name}_*.deb"))
        if proc.returncode != 0 or not debs:
            raise SystemExit(
                f"could not obtain Debian package {name!r} (not installed; `apt-get download {name}` "
                f"failed: {proc.stderr.strip()[-500:]}).\nRun `apt-get update` first, or "
                f"`apt-get install {name}`."
            )
        version = _run(["dpkg-deb", "-f", str(debs[0]), "Version"]).stdout.strip()
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        _run(["dpkg", "-x", str(debs[0]), str(dest)])
    if not (dest / probe).exists():
        raise SystemExit(f"package {name} {version} has no {probe}")
    stamp.write_text(version + "\n")
    return Package(name, version, dest, "apt-get download")


# --------------------------------------------------------------------------------------------
# Text helpers
# --------------------------------------------------------------------------------------------

_WS = re.compile(r"[ \t\r\f\v\u00a0\u2009\u200b]+")


def clean_line(s: str) -> str:
    s = unicodedata.normalize("NFC", s)
    s = s.replace("\u00ad", "").replace("\ufeff", "")
    s = "".join(ch if ch >= " " or ch == "\n" else " " for ch in s)
    return _WS.sub(" ", s).strip()


def unwrap_blocks(text: str, keep_verse: bool = True) -> list[str]:
    """Split hard-wrapped plain text into paragraphs (blank-line separated blocks).

    Each block becomes one line, like a C4 line; blocks that look like verse (every line indented
    and short) keep their line breaks, one paragraph per verse line.
    """
    paras: list[str] = []
    for block in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
        lines = [ln for ln in block.split("\n") if ln.strip()]
        if not lines:
            continue
        verse = (
            keep_verse
            and len(lines) > 1
            and all(ln.startswith("  ") and len(ln.strip()) < 70 for ln in lines)
        )
        if verse:
            paras.extend(clean_line(ln) for ln in lines)
        else:
            paras.append(clean_line(" ".join(ln.strip() for ln in lines)))
    return [p for p in paras if p]


def prose_like(p: str, min_alpha: float = 0.6) -> bool:
    """Reject ASCII art, tables of symbols, hex dumps and the like."""
    if not p:
        return False
    letters = sum(ch.isalpha() for ch in p)
    spaces = p.count(" ")
    return (letters + spaces) / len(p) >= min_alpha and letters >= 2


def split_long_paragraph(p: str, limit: int = MAX_DOC_CHARS - 200) -> list[str]:
    """Split a paragraph longer than ``limit`` at sentence ends (or, failing that, spaces)."""
    if len(p) <= limit:
        return [p]
    sentences = re.split(r"(?<=[.!?;:])\s+", p)
    out: list[str] = []
    cur = ""
    for s in sentences:
        while len(s) > limit:  # a "sentence" without punctuation: cut at a space
            cut = s.rfind(" ", 0, limit)
            cut = cut if cut > limit // 2 else limit
            head, s = s[:cut].strip(), s[cut:].strip()
            if cur:
                out.append(cur)
                cur = ""
            out.append(head)
        if cur and len(cur) + 1 + len(s) > limit:
            out.append(cur)
            cur = s
        else:
            cur = f"{cur} {s}" if cur else s
    if cur:
        out.append(cur)
    return out


# --------------------------------------------------------------------------------------------
# Works and documents
# --------------------------------------------------------------------------------------------


@dataclass
class Work:
    source: str  # key into SOURCE_INFO
    url: str  # identifies the source work; documents get url + "#part-<n>"
    paragraphs: list[str]


@dataclass
class Doc:
    text: str
    url: str
    source: str


def cut_work(work: Work) -> list[Doc]:
    """Cut a work into paragraph-aligned documents of roughly 1,000-3,000 characters."""
    rng = random.Random(f"{SEED}:{work.url}")
    paras: list[str] = []
    for p in work.paragraphs:
        paras.extend(split_long_paragraph(p))
    chunks: list[list[str]] = []
    cur: list[str] = []
    cur_len = 0

    def new_target() -> int:
        t = rng.lognormvariate(math.log(MEDIAN_DOC_CHARS), 0.35)
        return int(min(MAX_DOC_CHARS - 300, max(MIN_DOC_CHARS, t)))

    target = new_target()
    for p in paras:
        if cur and cur_len + 1 + len(p) > MAX_DOC_CHARS:
            chunks.append(cur)
            cur, cur_len, target = [], 0, new_target()
        cur.append(p)
        cur_len += len(p) + (1 if cur_len else 0)
        if cur_len >= target:
            chunks.append(cur)
            cur, cur_len, target = [], 0, new_target()
    if cur:
        tail_len = sum(map(len, cur)) + len(cur) - 1
        if (
            tail_len < MIN_TAIL_CHARS
            and chunks
            and sum(map(len, chunks[-1])) + tail_len < MAX_DOC_CHARS + 500
        ):
            chunks[-1].extend(cur)
        elif tail_len >= MIN_TAIL_CHARS:
            chunks.append(cur)
    docs = []
    for i, chunk in enumerate(chunks):
        text = "\n".join(chunk)
        if len(text) < MIN_TAIL_CHARS:
            continue
        docs.append(Doc(text=text, url=f"{work.url}#part-{i + 1}", source=work.source))
    return docs


# --------------------------------------------------------------------------------------------
# Source: King James Bible (bible-kjv-text, read with the `bible` program from bible-kjv)
# --------------------------------------------------------------------------------------------

BIBLE_BOOKS = [
    "Genesis",
    "Exodus",
    "Leviticus",
    "Numbers",
    "Deuteronomy",
    "Joshua",
    "Judges",
    "Ruth",
    "1 Samuel",
    "2 Samuel",
    "1 Kings",
    "2 Kings",
    "1 Chronicles",
    "2 Chronicles",
    "Ezra",
    "Nehemiah",
    "Esther",
    "Job",
    "Psalms",
    "Proverbs",
    "Ecclesiastes",
    "Song of Solomon",
    "Isaiah",
    "Jeremiah",
    "Lamentations",
    "Ezekiel",
    "Daniel",
    "Hosea",
    "Joel",
    "Amos",
    "Obadiah",
    "Jonah",
    "Micah",
    "Nahum",
    "Habakkuk",
    "Zephaniah",
    "Haggai",
    "Zechariah",
    "Malachi",
    "Matthew",
    "Mark",
    "Luke",
    "John",
    "Acts",
    "Romans",
    "1 Corinthians",
    "2 Corinthians",
    "Galatians",
    "Ephesians",
    "Philippians",
    "Colossians",
    "1 Thessalonians",
    "2 Thessalonians",
    "1 Timothy",
    "2 Timothy",
    "Titus",
    "Philemon",
    "Hebrews",
    "James",
    "1 Peter",
    "2 Peter",
    "1 John",
    "2 John",
    "3 John",
    "Jude",
    "Revelation",
]


def slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")


def kjv_works(cache: Path, packages: dict[str, Package]) -> list[Work]:
    text_pkg = get_package("bible-kjv-text", "usr/lib/bible.data", cache)
    prog_pkg = get_package("bible-kjv", "usr/bin/bible", cache)
    packages[text_pkg.name] = text_pkg
    packages[prog_pkg.name] = prog_pkg
    cmd = [
        str(prog_pkg.root / "usr/bin/bible"),
        "-f",
        "-p",
        str(text_pkg.root / "usr/lib"),
        "Gen1:1-Rev22:21",
    ]
    try:
        out = _run(cmd, env={**os.environ, "COLUMNS": "80"}).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(
            f"running the `bible` program of bible-kjv failed ({e}); it needs libreadline8 "
            "(`apt-get install bible-kjv` installs everything)"
        ) from e
    verse_re = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")
    books: list[tuple[str, list[tuple[int, str]]]] = []
    last_abbrev = None
    for line in out.splitlines():
        m = verse_re.match(line)
        if not m:
            if line.strip():
                raise SystemExit(f"unexpected `bible` output line: {line!r}")
            continue
        abbrev, chapter, verse_text = m.group(1), int(m.group(2)), m.group(4)
        if abbrev != last_abbrev:
            books.append((abbrev, []))
            last_abbrev = abbrev
        books[-1][1].append((chapter, clean_line(verse_text)))
    if len(books) != len(BIBLE_BOOKS):
        raise SystemExit(f"expected 66 books from `bible`, got {len(books)}")
    works = []
    for name, (_abbrev, verses) in zip(BIBLE_BOOKS, books):
        paras: list[str] = []
        last_chapter = None
        for chapter, verse in verses:
            if chapter != last_chapter:
                paras.append(f"{name} {chapter}" if name != "Psalms" else f"Psalm {chapter}")
                last_chapter = chapter
            paras.append(verse)
        works.append(Work("kjv", f"https://packages.debian.org/bookworm/bible-kjv-text/{slug(name)}", paras))
    return works


# --------------------------------------------------------------------------------------------
# Source: Jane Austen's six novels (r-cran-janeaustenr, an R lazy-load database)
# --------------------------------------------------------------------------------------------


class _RUnserializer:
    """Minimal reader for R's XDR serialization format (enough for character vectors and lists)."""

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.b, self.i, self.refs = data, 2, []
        version = self._int()
        self._int(), self._int()  # writer and minimal reader R versions
        if version == 3:
            n = self._int()  # length of the native encoding name, then the name
            self.i += n

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.b, self.i)
        self.i += 4
        return v

    def read(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (254, 242, 253, 251):  # NULL, empty env, global env, missing arg
            return None
        if kind == 255:  # reference
            idx = flags >> 8 or self._int()
            return self.refs[idx - 1]
        if kind == 1:  # symbol
            sym = self.read()
            self.refs.append(sym)
            return sym
        if kind == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            s = self.b[self.i : self.i + n].decode("utf-8", "replace")
            self.i += n
            return s
        if kind == 2:  # pairlist -> dict
            if has_attr:
                self.read()
            tag = self.read() if has_tag else None
            car, cdr = self.read(), self.read()
            return {tag: car, **(cdr if isinstance(cdr, dict) else {})}
        if kind in (10, 13, 14, 16, 19, 20):
            n = self._int()
            if kind in (16, 19, 20):
                value = [self.read() for _ in range(n)]
            elif kind in (10, 13):
                value = list(struct.unpack_from(f">{n}i", self.b, self.i))
                self.i += 4 * n
            else:
                value = list(struct.unpack_from(f">{n}d", self.b, self.i))
                self.i += 8 * n
            attrs = self.read() if has_attr else None
            return RVector(kind, value, attrs or {})
        raise ValueError(f"unsupported R SEXP type {kind}")


@dataclass
class RVector:
    kind: int
    value: list
    attrs: dict = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return self.attrs["names"].value


def read_r_lazyload(base: Path) -> dict[str, RVector]:
    """Read every object of an R lazy-load database (``base.rdx`` + ``base.rdb``)."""
    index = _RUnserializer(gzip.decompress(base.with_suffix(".rdx").read_bytes())).read()
    variables = index.value[index.names.index("variables")]
    rdb = base.with_suffix(".rdb").read_bytes()
    out = {}
    for name, pos in zip(variables.names, variables.value):
        off, length = pos.value
        blob = rdb[off : off + length]
        out[name] = _RUnserializer(zlib.decompress(blob[4:])).read()
    return out


# (object name in janeaustenr, title, Project Gutenberg ebook number, first chapter of each volume)
AUSTEN_NOVELS = [
    ("sensesensibility", "Sense and Sensibility", 161, [1, 23, 37]),
    ("prideprejudice", "Pride and Prejudice", 1342, [1, 24, 43]),
    ("mansfieldpark", "Mansfield Park", 141, [1, 19, 32]),
    ("emma", "Emma", 158, None),  # the text itself has VOLUME I/II/III headings
    ("northangerabbey", "Northanger Abbey", 121, [1, 16]),
    ("persuasion", "Persuasion", 105, [1, 13]),
]
_ROMAN = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100}


def _roman(s: str) -> int:
    if s.isdigit():
        return int(s)
    total = 0
    for a, b in zip(s, s[1:] + " "):
        v = _ROMAN[a]
        total += -v if b != " " and _ROMAN[b] > v else v
    return total


def austen_works(cache: Path, packages: dict[str, Package]) -> list[Work]:
    rel = "usr/lib/R/site-library/janeaustenr/data/Rdata"
    pkg = get_package("r-cran-janeaustenr", rel + ".rdb", cache)
    packages[pkg.name] = pkg
    objects = read_r_lazyload(pkg.root / rel)
    chapter_re = re.compile(r"^(?:CHAPTER|Chapter) ([IVXLC]+|\d+)\.?$")
    works = []
    for key, title, ebook, volume_starts in AUSTEN_NOVELS:
        lines = [ln or "" for ln in objects[key].value]
        volumes: list[list[str]] = []
        started = False
        for ln in lines:
            s = ln.strip()
            if s in ("THE END", "FINIS"):
                break
            if re.fullmatch(r"VOLUME [IVX]+", s):
                volumes.append([])
                continue
            m = chapter_re.match(s)
            if m:
                started = True
                chapter = _roman(m.group(1))
                if not volumes or (volume_starts is not None and chapter in volume_starts):
                    volumes.append([])
                volumes[-1].append(f"\n\nChapter {chapter}\n\n")
                continue
            if started:
                volumes[-1].append(ln)
        if len(volumes) != (3 if volume_starts is None else len(volume_starts)):
            raise SystemExit(f"{title}: found {len(volumes)} volumes")
        for v, vol_lines in enumerate(volumes, 1):
            paras = unwrap_blocks("\n".join(vol_lines), keep_verse=False)
            url = f"https://www.gutenberg.org/ebooks/{ebook}/volume-{v}"
            works.append(Work("austen", url, [p for p in paras if p]))
    return works


# --------------------------------------------------------------------------------------------
# Source: The Devil's Dictionary (dict-devil, a dictd database)
# --------------------------------------------------------------------------------------------


_DICTD_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _dictd_number(s: str) -> int:
    v = 0
    for ch in s:
        v = v * 64 + _DICTD_B64.index(ch)
    return v


def devil_works(cache: Path, packages: dict[str, Package]) -> list[Work]:
    base = "usr/share/dictd/devil"
    pkg = get_package("dict-devil", base + ".dict.dz", cache)
    packages[pkg.name] = pkg
    raw = gzip.decompress((pkg.root / (base + ".dict.dz")).read_bytes())
    entries = []  # (offset, length, headword) from the dictd index
    for line in (pkg.root / (base + ".index")).read_text(encoding="utf-8").splitlines():
        word, off, length = line.split("\t")
        entries.append((_dictd_number(off), _dictd_number(length), word))
    entries.sort()
    works: dict[str, list[str]] = defaultdict(list)
    for off, length, word in entries:
        text = raw[off : off + length].decode("utf-8")
        if word == "00databaseinfo":  # holds the book's front matter; keep its preface
            text = text[text.index("PREFACE") + len("PREFACE") :]
            key = "preface"
        elif word.startswith("00database"):
            continue
        else:
            key = word[0].lower() if word[0].isalpha() else "preface"
        # drop initials that sign quotations and the preface ("A.B.", "G.J.")
        works[key].extend(p for p in unwrap_blocks(text) if not re.fullmatch(r"(?:[A-Z]\.){2,3}", p))
    return [
        Work("devil", f"https://packages.debian.org/bookworm/dict-devil/{k}", v) for k, v in works.items()
    ]


# --------------------------------------------------------------------------------------------
# Source: The Jargon File 4.4.7 (jargon-text)
# --------------------------------------------------------------------------------------------


def jargon_works(cache: Path, packages: dict[str, Package]) -> list[Work]:
    rel = "usr/share/doc/jargon-text/jargon.txt.gz"
    pkg = get_package("jargon-text", rel, cache)
    packages[pkg.name] = pkg
    lines = gzip.decompress((pkg.root / rel).read_bytes()).decode("utf-8").splitlines()
    # Layout: table of contents, then the lexicon in sections headed "  0", "  A" .. "  Z" (each opening
    # with a list of its entries' names), then "Appendix A/B/C" sections.
    section_re = re.compile(r"^  ([0A-Z])$")
    appendix_re = re.compile(r"^Appendix[ \u00a0]([ABC])\.[ \u00a0]")
    sections: list[tuple[str, list[str]]] = []
    for ln in lines:
        m = section_re.match(ln)
        a = appendix_re.match(ln)
        if m:
            sections.append((m.group(1), []))
        elif a:
            sections.append((f"appendix{a.group(1).lower()}", []))
        elif sections:
            sections[-1][1].append(ln)
    works = []
    for name, body in sections:
        if not name.startswith("appendix"):
            # drop the per-letter list of entry names: the first entry starts with "   :Headword:"
            first = next((i for i, ln in enumerate(body) if re.match(r"^   :.+:", ln)), None)
            if first is None:
                continue
            body = body[first:]
        text = "\n".join(body)
        text = re.sub(r"[{}]", "", text)  # {cross references}
        # every line is indented by three spaces, so indented verse cannot be told from prose: unwrap all
        paras = [p for p in unwrap_blocks(text, keep_verse=False) if prose_like(p, 0.7)]
        url = (
            f"http://www.catb.org/jargon/html/{name}.html"
            if name.startswith("appendix")
            else f"http://www.catb.org/jargon/html/{name}/"
        )
        works.append(Work("jargon", url.replace("http://", "https://"), paras))
    return works


# --------------------------------------------------------------------------------------------
# Source: the Dhammapada, tr. John Richards (display-dhammapada)
# --------------------------------------------------------------------------------------------


def dhammapada_works(cache: Path, packages: dict[str, Package]) -> list[Work]:
    rel = "usr/share/display-dhammapada/dhammapada-english-transl.txt"
    pkg = get_package("display-dhammapada", rel, cache)
    packages[pkg.name] = pkg
    text = (pkg.root / rel).read_text(encoding="utf-8", errors="replace")
    text = text[text.index("The Dhammapada - Information") :]
    paras = [p for p in unwrap_blocks(text, keep_verse=False) if prose_like(p) and not set(p) <= set("-=*")]
    return [Work("dhammapada", "https://packages.debian.org/bookworm/display-dhammapada/dhammapada", paras)]


# --------------------------------------------------------------------------------------------
# Source: WordNet 3.0 glosses with usage examples (wordnet-base)
# --------------------------------------------------------------------------------------------

# lexicographer file names, indexed by the file numbers 0-44 of the data files (see lexnames(5WN))
WORDNET_LEXNAMES = [
    "adj.all",
    "adj.pert",
    "adv.all",
    "noun.Tops",
    "noun.act",
    "noun.animal",
    "noun.artifact",
    "noun.attribute",
    "noun.body",
    "noun.cognition",
    "noun.communication",
    "noun.event",
    "noun.feeling",
    "noun.food",
    "noun.group",
    "noun.location",
    "noun.motive",
    "noun.object",
    "noun.person",
    "noun.phenomenon",
    "noun.plant",
    "noun.possession",
    "noun.process",
    "noun.quantity",
    "noun.relation",
    "noun.shape",
    "noun.state",
    "noun.substance",
    "noun.time",
    "verb.body",
    "verb.change",
    "verb.cognition",
    "verb.communication",
    "verb.competition",
    "verb.consumption",
    "verb.contact",
    "verb.creation",
    "verb.emotion",
    "verb.motion",
    "verb.perception",
    "verb.possession",
    "verb.social",
    "verb.stative",
    "verb.weather",
    "adj.ppl",
]
WORDNET_POS = {"n": "noun", "v": "verb", "a": "adjective", "s": "adjective", "r": "adverb"}
WORDNET_MAX_WORK_CHARS = 80_000


def _unit_hash(s: str) -> float:
    """A stable pseudo-random number in [0, 1) derived from ``s``."""
    return int.from_bytes(hashlib.sha256(s.encode("utf-8")).digest()[:8], "big") / 2**64


def wordnet_works(cache: Path, packages: dict[str, Package]) -> list[Work]:
    """One line per synset that has a quoted usage example: "lemma, lemma (pos): gloss; "example"".

    Works are lexicographer files (noun.animal, verb.motion, ...); from a file with more than ~80k characters
    of such lines, a stable pseudo-random subset of about that size is kept.
    """
    rel = "usr/share/wordnet"
    pkg = get_package("wordnet-base", rel + "/data.noun", cache)
    packages[pkg.name] = pkg
    by_lex: dict[str, list[str]] = defaultdict(list)
    for pos in ("noun", "verb", "adj", "adv"):
        for line in (pkg.root / rel / f"data.{pos}").read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or " | " not in line:  # licence header
                continue
            head, gloss = line.split(" | ", 1)
            gloss = clean_line(gloss)
            if '"' not in gloss:
                continue
            f = head.split()
            lex, ss_type, n_words = WORDNET_LEXNAMES[int(f[1])], f[2], int(f[3], 16)
            words = [re.sub(r"\([a-z]+\)$", "", f[4 + 2 * i]).replace("_", " ") for i in range(n_words)]
            by_lex[lex].append(f"{', '.join(words)} ({WORDNET_POS[ss_type]}): {gloss}")
    works = []
    for lex in WORDNET_LEXNAMES:
        lines = by_lex.get(lex, [])
        total = sum(map(len, lines))
        if total > WORDNET_MAX_WORK_CHARS:  # keep a stable pseudo-random subset, in database order
            keep = WORDNET_MAX_WORK_CHARS / total
            lines = [ln for ln in lines if _unit_hash(ln) < keep]
        if sum(map(len, lines)) >= 500:
            works.append(Work("wordnet", f"https://wordnet.princeton.edu/wordnet-3.0/{lex}", lines))
    return works


# --------------------------------------------------------------------------------------------
# HTML documentation (Python, SQLite)
# --------------------------------------------------------------------------------------------

_BLOCK_TAGS = {
    "p",
    "li",
    "dd",
    "dt",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "div",
    "section",
    "blockquote",
    "br",
    "tr",
    "ul",
    "ol",
    "dl",
    "table",
    "caption",
    "figcaption",
    "td",
    "th",
    "hr",
}
_VOID_TAGS = {"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed", "source", "wbr"}


class DocHTMLParser(HTMLParser):
    """Collects paragraphs of visible prose from a documentation page.

    ``root`` (a predicate on (tag, attrs)) limits collection to one element's subtree;
    ``skip`` (same signature) drops whole subtrees (code blocks, navigation, tables...).
    """

    def __init__(self, root=None, skip=None):
        super().__init__(convert_charrefs=True)
        self.root, self.skip = root, skip
        self.root_stack: list[str] | None = None if root else []
        self.skip_tag: str | None = None
        self.skip_depth = 0
        self.paras: list[str] = []
        self.buf: list[str] = []

    def _flush(self):
        text = clean_line("".join(self.buf).replace("\n", " "))
        self.buf = []
        if text:
            self.paras.append(text)

    def handle_starttag(self, tag, attrs):
        a = {k: (v or "") for k, v in attrs}
        if self.skip_tag is not None:
            if tag == self.skip_tag:
                self.skip_depth += 1
            return
        if self.root_stack is None:
            if self.root(tag, a):
                self.root_stack = [tag]
            return
        if self.skip and self.skip(tag, a):
            if tag not in _VOID_TAGS:
                self.skip_tag, self.skip_depth = tag, 1
            self._flush()
            return
        if tag in _BLOCK_TAGS:
            self._flush()
        if self.root and tag == self.root_stack[0] and tag not in _VOID_TAGS:
            self.root_stack.append(tag)

    def handle_endtag(self, tag):
        if self.skip_tag is not None:
            if tag == self.skip_tag:
                self.skip_depth -= 1
                if self.skip_depth == 0:
                    self.skip_tag = None
            return
        if self.root_stack is None:
            return
        if tag in _BLOCK_TAGS:
            self._flush()
        if self.root and self.root_stack and tag == self.root_stack[0]:
            self.root_stack.pop()
            if not self.root_stack:
                self._flush()
                self.root_stack = None
                self.root = lambda t, a: False  # collect the first matching root only

    def handle_data(self, data):
        if self.skip_tag is None and self.root_stack is not None:
            self.buf.append(data)

    def close(self):
        super().close()
        self._flush()


def _classes(a: dict) -> set[str]:
    return set(a.get("class", "").split())


def _py_skip(tag: str, a: dict) -> bool:
    c = _classes(a)
    if tag in ("pre", "script", "style", "table", "nav", "math", "svg", "object"):
        return True
    if tag == "a" and "headerlink" in c:
        return True
    if tag == "dt" and "sig" in c:  # API signatures
        return True
    if tag == "div" and any(k.startswith("highlight") for k in c):
        return True
    return bool(c & {"toctree-wrapper", "contents", "topic", "versionmodified-placeholder", "sphinxsidebar"})


def _py_root(tag: str, a: dict) -> bool:
    return tag == "div" and a.get("role") == "main"


PY_SKIP_PAGES = re.compile(
    r"^(genindex.*|py-modindex|search|contents|index|copyright|license|download|bugs|about"
    r"|whatsnew/changelog|whatsnew/index|library/index|c-api/index|reference/index|tutorial/index"
    r"|howto/index|faq/index|extending/index|using/index|distutils/index|install/index)\.html$"
)


def python_doc_works(cache: Path, packages: dict[str, Package], doc_package: str) -> list[Work]:
    version = doc_package.removeprefix("python").removesuffix("-doc")
    rel = f"usr/share/doc/python{version}/html"
    pkg = get_package(doc_package, rel + "/index.html", cache)
    packages[pkg.name] = pkg
    root = pkg.root / rel
    works = []
    for path in sorted(root.rglob("*.html")):
        page = path.relative_to(root).as_posix()
        if page.startswith(("_", "includes/")) or PY_SKIP_PAGES.match(page):
            continue
        parser = DocHTMLParser(root=_py_root, skip=_py_skip)
        parser.feed(path.read_text(encoding="utf-8", errors="replace"))
        parser.close()
        paras = [p.replace("¶", "").strip() for p in parser.paras]
        paras = [p for p in paras if prose_like(p, 0.7)]
        if sum(map(len, paras)) >= 400:
            works.append(Work("python", f"https://docs.python.org/{version}/{page}", paras))
    return works


def _sqlite_skip(tag: str, a: dict) -> bool:
    c = _classes(a)
    if tag in ("pre", "script", "style", "table", "svg", "map", "form", "object", "blockquote"):
        return True
    if tag == "div" and c & {"nosearch", "imgcontainer", "codeblock", "fancy_toc", "tagline", "menu"}:
        return True
    return tag in ("div", "span") and "tokenlist" in c


# index / cross-reference / very list-like pages that have little prose
SQLITE_SKIP_PAGES = re.compile(
    r"^(doc_.*|keyword_index|sitemap|toc|docs|index|capi3ref|changes|chronology|oldnews|news|requirements"
    r"|sqlite|famous|copyright-release|download|support|prosupport|mostdeployed|consortium|books"
    r"|c3ref.*|syntax.*|releaselog.*|session.*|rescode|opcode|pragma_.*|compile|limits|fileio|spellfix1)\.html$"
)


def sqlite_doc_works(cache: Path, packages: dict[str, Package]) -> list[Work]:
    pkg = get_package("sqlite3-doc", "usr/share/doc/sqlite3/index.html", cache)
    packages[pkg.name] = pkg
    root = pkg.root / "usr/share/doc/sqlite3"
    works = []
    for path in sorted(root.glob("*.html")):
        page = path.name
        if SQLITE_SKIP_PAGES.match(page):
            continue
        parser = DocHTMLParser(root=lambda t, a: t == "body", skip=_sqlite_skip)
        parser.feed(path.read_text(encoding="utf-8", errors="replace"))
        parser.close()
        paras = [p for p in parser.paras if prose_like(p, 0.75) and len(p) >= 40]
        if sum(map(len, paras)) >= 600:
            works.append(Work("sqlite", f"https://www.sqlite.org/{page}", paras))
    return works


# --------------------------------------------------------------------------------------------
# Source descriptions (for PROVENANCE.md)
# --------------------------------------------------------------------------------------------

SOURCE_INFO = {
    "kjv": {
        "title": "The Holy Bible, King James Version (1611/1769 text)",
        "packages": ["bible-kjv-text", "bible-kjv"],
        "origin": "Chip Chapin's Bible Retrieval System (ftp.funet.fi:/pub/doc/religion/christian/Bible/unix), "
        "packaged for Debian; the compressed text is read with the `bible` program of `bible-kjv`",
        "licence": "Public domain (the KJV text's copyright has expired; Debian copyright file). The `bible` "
        "program (GPL-2+) is only run as a tool; none of its code is included",
        "work": "one book of the Bible (66 works)",
        "url": "https://packages.debian.org/bookworm/bible-kjv-text/<book>",
        "cut": "one verse per line (verse numbers dropped), a '<Book> <chapter>' line before each chapter",
    },
    "austen": {
        "title": "Jane Austen's six completed novels (Sense and Sensibility, Pride and Prejudice, Mansfield "
        "Park, Emma, Northanger Abbey, Persuasion)",
        "packages": ["r-cran-janeaustenr"],
        "origin": "janeaustenr 1.0.0 by Julia Silge (https://github.com/juliasilge/janeaustenr), texts from "
        "Project Gutenberg; read from the package's R lazy-load database with a small XDR reader",
        "licence": "Public domain texts (published 1811-1818); the janeaustenr package is MIT-licensed",
        "work": "one volume of a novel, following the first editions' volume breaks (16 works)",
        "url": "https://www.gutenberg.org/ebooks/<Gutenberg ebook number>/volume-<n>",
        "cut": "title pages and 'THE END' dropped, hard-wrapped lines joined into one line per paragraph, a "
        "'Chapter <n>' line before each chapter",
    },
    "devil": {
        "title": "The Devil's Dictionary by Ambrose Bierce (1911 edition)",
        "packages": ["dict-devil"],
        "origin": "Internet Wiretap 1st Online Edition (1993), "
        "http://wiretap.area.com/Gopher/Library/Classic/devils.txt, as a dictd database",
        "licence": "Public domain (copyright expired; Debian copyright file)",
        "work": "the preface, and the entries under one initial letter",
        "url": "https://packages.debian.org/bookworm/dict-devil/<letter>",
        "cut": "dictd header dropped, one line per paragraph, verse keeps its line breaks",
    },
    "jargon": {
        "title": "The Jargon File, version 4.4.7 (29 Dec 2003), ed. Eric S. Raymond",
        "packages": ["jargon-text"],
        "origin": "http://www.catb.org/~esr/jargon/ (plain-text rendering shipped by Debian)",
        "licence": 'Public domain ("This document (the Jargon File) is in the public domain, to be freely '
        'used, shared, and modified")',
        "work": "the lexicon entries under one initial letter, or one appendix",
        "url": "https://www.catb.org/jargon/html/<letter>/ and https://www.catb.org/jargon/html/appendix<x>.html",
        "cut": "tables of contents and ASCII art dropped, {cross-reference} braces removed, one line per "
        "paragraph",
    },
    "dhammapada": {
        "title": "The Dhammapada, translated from Pali by John Richards (1993)",
        "packages": ["display-dhammapada"],
        "origin": "COOMBSPAPERS archive (coombs.anu.edu.au), shipped by display-dhammapada",
        "licence": "Public domain (Debian copyright file: 'Public Domain, as explained at "
        "http://creativecommons.org/licenses/publicdomain')",
        "work": "the whole book (1 work)",
        "url": "https://packages.debian.org/bookworm/display-dhammapada/dhammapada",
        "cut": "archive header dropped, one line per paragraph",
    },
    "wordnet": {
        "title": "WordNet 3.0 (Princeton University): glosses and usage examples",
        "packages": ["wordnet-base"],
        "origin": "https://wordnet.princeton.edu/ (database files shipped by Debian); only synsets whose "
        "gloss has a quoted usage example",
        "licence": "WordNet 3.0 licence (permissive, BSD-like; notice reproduced below)",
        "work": "one lexicographer file (noun.animal, verb.motion, ...); from the larger files a stable "
        "hash-selected subset of ~80k characters",
        "url": "https://wordnet.princeton.edu/wordnet-3.0/<lexname>",
        "cut": "one line per synset: 'lemma, lemma (part of speech): gloss; \"example\"', in database order",
    },
    "python": {
        "title": "The Python 3 documentation (tutorial, library and language reference, HOWTOs, FAQs, "
        "What's New, C API)",
        "packages": ["python3.11-doc"],
        "origin": "https://docs.python.org/3.11/ (HTML build shipped by Debian)",
        "licence": "PSF License Agreement (Python Software Foundation License Version 2), permissive",
        "work": "one HTML page",
        "url": "https://docs.python.org/3.11/<page>.html",
        "cut": "main content only; code blocks, tables, API signatures, navigation and index pages "
        "dropped; one line per paragraph / list item",
    },
    "sqlite": {
        "title": "The SQLite documentation (3.40)",
        "packages": ["sqlite3-doc"],
        "origin": "https://www.sqlite.org/ (HTML documentation shipped by Debian)",
        "licence": "Public domain (D. Richard Hipp; Debian copyright file)",
        "work": "one HTML page",
        "url": "https://www.sqlite.org/<page>.html",
        "cut": "navigation, code blocks, tables and syntax diagrams dropped; C API reference, release logs and "
        "index pages skipped; one line per paragraph",
    },
}


LICENCE_NOTICES = """\
### WordNet 3.0 (wordnet source)

WordNet 3.0 Copyright 2006 by Princeton University. All rights reserved.

Permission to use, copy, modify and distribute this software and database and its documentation for any
purpose and without fee or royalty is hereby granted, provided that you agree to comply with the following
copyright notice and statements, including the disclaimer, and that the same appear on ALL copies of the
software, database and documentation, including modifications that you make for internal use or for
distribution.

THIS SOFTWARE AND DATABASE IS PROVIDED "AS IS" AND PRINCETON UNIVERSITY MAKES NO REPRESENTATIONS OR
WARRANTIES, EXPRESS OR IMPLIED. BY WAY OF EXAMPLE, BUT NOT LIMITATION, PRINCETON UNIVERSITY MAKES NO
REPRESENTATIONS OR WARRANTIES OF MERCHANTABILITY OR FITNESS FOR ANY PARTICULAR PURPOSE OR THAT THE USE
OF THE LICENSED SOFTWARE, DATABASE OR DOCUMENTATION WILL NOT INFRINGE ANY THIRD PARTY PATENTS,
COPYRIGHTS, TRADEMARKS OR OTHER RIGHTS.

The name of Princeton University or Princeton may not be used in advertising or publicity pertaining to
distribution of the software and/or database. Title to copyright in this software, database and any
associated documentation shall at all times remain with Princeton University and LICENSEE agrees to
preserve same.

### Python documentation (python source)

Copyright (c) 2001-2023 Python Software Foundation. All rights reserved. Copyright (c) 2000 BeOpen.com.
Copyright (c) 1995-2000 Corporation for National Research Initiatives. Copyright (c) 1991-1995 Stichting
Mathematisch Centrum. The documentation is licensed under the Python Software Foundation License
Version 2 (https://docs.python.org/3.11/license.html); the excerpts here are a derivative work made under
that licence (text extracted from the HTML pages, code examples removed).

### janeaustenr (austen source)

The novels are in the public domain. The janeaustenr R package that carries them is Copyright 2016-2017
Julia Silge, MIT licence: Permission is hereby granted, free of charge, to any person obtaining a copy of
this software and associated documentation files (the "Software"), to deal in the Software without
restriction, including without limitation the rights to use, copy, modify, merge, publish, distribute,
sublicense, and/or sell copies of the Software, and to permit persons to whom the Software is furnished to
do so, subject to the following conditions: The above copyright notice and this permission notice shall
be included in all copies or substantial portions of the Software. THE SOFTWARE IS PROVIDED "AS IS",
WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED.

### Public-domain sources

The King James Bible, The Devil's Dictionary, the Jargon File, the Dhammapada translation and the SQLite
documentation are in the public domain; no notice is required.
"""


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def is_validation(text: str) -> bool:
    h = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")
    return h % 1000 < VALIDATION_PER_MILLE


def write_jsonl_gz(path: Path, docs: Iterable[Doc]) -> None:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        for d in docs:
            line = json.dumps({"text": d.text, "timestamp": TIMESTAMP, "url": d.url}, ensure_ascii=False)
            gz.write(line.encode("utf-8") + b"\n")
    path.write_bytes(buf.getvalue())


def train_tokenizer(texts: list[str], out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def batches() -> Iterator[list[str]]:
        for i in range(0, len(texts), 1000):
            yield texts[i : i + 1000]

    tok.train_from_iterator(batches(), trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    # Like Mistral-7B: prepend <s>, never append </s>.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
            ),
        ]
    )
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    tok.save(str(out_dir / "tokenizer.json"))
    # Written by hand (not save_pretrained) so that the files are loadable by every transformers version the
    # project allows: "PreTrainedTokenizerFast" is understood by 4.x and 5.x alike.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "left",  # as Mistral's (Llama) fast tokenizer
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")
    return AutoTokenizer.from_pretrained(str(out_dir))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where downloaded .debs are unpacked")
    ap.add_argument(
        "--python-doc-package", default="python3.11-doc", help="Debian package of the Python docs"
    )
    args = ap.parse_args()

    packages: dict[str, Package] = {}
    works: list[Work] = []
    works += kjv_works(args.cache, packages)
    works += austen_works(args.cache, packages)
    works += devil_works(args.cache, packages)
    works += jargon_works(args.cache, packages)
    works += dhammapada_works(args.cache, packages)
    works += wordnet_works(args.cache, packages)
    works += python_doc_works(args.cache, packages, args.python_doc_package)
    works += sqlite_doc_works(args.cache, packages)
    if len({w.url for w in works}) != len(works):
        raise SystemExit("duplicate work urls")

    docs: list[Doc] = []
    seen: set[str] = set()
    for w in works:
        for d in cut_work(w):
            if d.text not in seen:  # exact duplicates would otherwise leak across splits
                seen.add(d.text)
                docs.append(d)
    train = [d for d in docs if not is_validation(d.text)]
    val = [d for d in docs if is_validation(d.text)]
    random.Random(SEED).shuffle(train)
    random.Random(SEED + 1).shuffle(val)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("c4-*.json.gz"):
        old.unlink()
    files: dict[str, list[Doc]] = {}
    for k in range(NUM_TRAIN_FILES):
        files[f"c4-train.{k:05d}-of-{NUM_TRAIN_FILES:05d}.json.gz"] = train[k::NUM_TRAIN_FILES]
    files["c4-validation.00000-of-00001.json.gz"] = val
    for name, ds in files.items():
        write_jsonl_gz(out / name, ds)

    tokenizer = train_tokenizer([d.text for d in train], out / "tokenizer")
    sample = "It is a truth universally acknowledged, that a single man in possession of a good fortune."
    ids = tokenizer(sample)["input_ids"]
    assert ids[0] == 1 and ids[-1] != 2 and tokenizer.decode(ids, skip_special_tokens=True) == sample

    def ntokens(ds: list[Doc]) -> int:
        enc = tokenizer([d.text for d in ds], add_special_tokens=False)["input_ids"]
        return sum(map(len, enc))

    write_provenance(out, works, files, train, val, packages, ntokens)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {len(train)} train / {len(val)} validation documents, {total / 1e6:.2f} MB in {out}")
    if total > MAX_TOTAL_GZIP_BYTES:
        raise SystemExit(f"sample is {total} bytes, over the {MAX_TOTAL_GZIP_BYTES} byte budget")


def source_rows(works, train, val, ntokens) -> list[str]:
    """The counts table's rows: one per source, then the total."""
    works_by_source = Counter(w.source for w in works)
    rows = []
    for src in SOURCE_INFO:
        tr = [d for d in train if d.source == src]
        va = [d for d in val if d.source == src]
        rows.append(
            f"| {src} | {works_by_source[src]} | {len(tr):,} | {sum(len(d.text) for d in tr):,} "
            f"| {ntokens(tr):,} | {len(va):,} | {sum(len(d.text) for d in va):,} | {ntokens(va):,} |"
        )
    n_tr_tok, n_va_tok = ntokens(train), ntokens(val)
    c_tr, c_va = sum(len(d.text) for d in train), sum(len(d.text) for d in val)
    rows.append(
        f"| **total** | {len(works)} | {len(train):,} | {c_tr:,} | {n_tr_tok:,} | {len(val):,} | {c_va:,} "
        f"| {n_va_tok:,} |"
    )
    return rows


def source_sections(packages) -> list[str]:
    """One "### source" section per source: its packages, origin, licence and preparation."""
    return [
        f"### {src}: {info['title']}\n\n"
        f"- Debian package(s): {', '.join(f'`{p}` {packages[p].version}' for p in info['packages'])}\n"
        f"- Original: {info['origin']}\n"
        f"- Licence: {info['licence']}\n"
        f"- Source work (document `url` without `#part-<n>`): {info['work']}; `{info['url']}`\n"
        f"- Preparation: {info['cut']}\n"
        for src, info in SOURCE_INFO.items()
    ]


def method_section(lengths: list[int]) -> str:
    """PROVENANCE.md's "How documents were made": the cutting, normalising and splitting rules."""
    return f"""## How documents were made

- Each source is divided into *source works* (a Bible book, a novel volume, a documentation page, ...).
  A document's `url` is `<work url>#part-<n>`; stripping the `#fragment` groups the parts of one work,
  so a non-IID sharding can hash works to shards. The work URLs name the real host the text comes from
  (the upstream site, or packages.debian.org where the text exists only as a Debian package); they are
  identifiers and need not all resolve.
- Text is Unicode-NFC normalised; runs of spaces/tabs collapse to one space; hard-wrapped lines are joined,
  so each paragraph (or verse line, list item) is one line, as in C4.
- Works are cut into paragraph-aligned documents: paragraphs are added until a per-document target
  length is reached (target drawn from a log-normal with median {MEDIAN_DOC_CHARS} characters, clipped to
  {MIN_DOC_CHARS}-{MAX_DOC_CHARS - 300}; no document grows past {MAX_DOC_CHARS} characters unless a short tail was
  merged into it; paragraphs over {MAX_DOC_CHARS - 200} characters are split at sentence ends). A final
  fragment under {MIN_TAIL_CHARS} characters is merged into the previous document, or dropped. Exact
  duplicate documents are dropped.
- Split: a document goes to validation when the first 8 bytes of SHA-256(text), as an integer, modulo 1000
  are below {VALIDATION_PER_MILLE} (about 5%); every other document goes to train. The splits share no text.
- Documents are shuffled with a seeded RNG (seed {SEED}); train is dealt round-robin into
  {NUM_TRAIN_FILES} files. `timestamp` is the fixed string `{TIMESTAMP}` for every document.
- Document lengths (both splits): min {lengths[0]:,}, median {lengths[len(lengths) // 2]:,},
  max {lengths[-1]:,} characters.

"""


def write_provenance(out, works, files, train, val, packages, ntokens) -> None:
    rows = source_rows(works, train, val, ntokens)
    lengths = sorted(len(d.text) for d in train + val)
    file_rows = [
        f"| `{name}` | {len(ds):,} | {sum(len(d.text) for d in ds):,} | {(out / name).stat().st_size:,} |"
        for name, ds in files.items()
    ]
    tok_bytes = sum(p.stat().st_size for p in (out / "tokenizer").rglob("*") if p.is_file())
    pkg_rows = [f"| `{p.name}` | {p.version} |" for p in sorted(packages.values(), key=lambda p: p.name)]
    src_sections = source_sections(packages)

    text = f"""# Provenance of the bundled C4-format sample

This directory is a small, offline stand-in for `allenai/c4` (`en`): gzip JSON-lines files whose lines
are `{{"text": ..., "timestamp": ..., "url": ...}}`, plus a byte-level BPE tokenizer trained on the
train split. It is built by `src/diloco/assets/sample/build_sample.py` from public-domain or permissively licensed English
texts that Debian ships as packages; nothing was taken from the web. The raw packages are not committed.

## Rebuild

```
apt-get update                                  # only if the packages must be downloaded
.venv/bin/python src/diloco/assets/sample/build_sample.py  # from the repository root
```

Optionally install the packages first (then nothing is downloaded):
`apt-get install bible-kjv r-cran-janeaustenr dict-devil jargon-text display-dhammapada wordnet-base
python3.11-doc sqlite3-doc`.

Each package is read from its installed location if installed, else fetched with `apt-get download`
and unpacked with `dpkg -x` into `~/.cache/diloco-sample-sources/` (override with `--cache`). The output
is byte-for-byte deterministic for the package versions below; other versions give a similar sample.

| Debian package (Debian 12 "bookworm") | version used |
| --- | --- |
{chr(10).join(pkg_rows)}

## Sources

{chr(10).join(src_sections)}
{method_section(lengths)}## Counts

Tokens are counted with the bundled tokenizer, without special tokens.

| source | works | train docs | train chars | train tokens | val docs | val chars | val tokens |
| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
{chr(10).join(rows)}

| file | documents | characters | bytes |
| --- | ---: | ---: | ---: |
{chr(10).join(file_rows)}
| `tokenizer/` | | | {tok_bytes:,} |

## Tokenizer

`tokenizer/` is a byte-level BPE (HF `tokenizers`, ByteLevel pre-tokenizer without prefix space,
ByteLevel decoder) trained on the train split only, vocabulary {VOCAB_SIZE} including the special tokens
`<unk>`=0, `<s>`=1, `</s>`=2 (the ids of Mistral-7B's tokenizer). As with Mistral's tokenizer, encoding
prepends `<s>` and appends no `</s>`; `pad_token` = `eos_token` = `</s>`, `bos_token` = `<s>`,
`unk_token` = `<unk>`, `model_max_length` = {MODEL_MAX_LENGTH:,}, `padding_side` = `left` (as for Mistral's
Llama-class fast tokenizer); `tokenizer_class` is `PreTrainedTokenizerFast`, so transformers 4.x and 5.x
both load it. Load it with
`transformers.AutoTokenizer.from_pretrained("src/diloco/assets/sample/tokenizer")`.

## Licence notices

{LICENCE_NOTICES}"""
    (out / "PROVENANCE.md").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
