"""The evaluation set of ``kvpage eval --suite``: texts of several kinds, found on the machine at run time.

Every member's text ships with this project's dependencies or the Python standard library and is
resolved where it lies (never downloaded); its sha256 is compared to the one recorded here, so a
different package or Python version shows up as a warning beside the numbers. Exactly one member is
**held back**: formats and their defaults are chosen on the others and it is reported on its own.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpage.model.encode import encode_text

#: The repository's verbatim copy of GPL-3 (``tests/data/GPL-3``), for machines without Debian's base-files.
_VENDORED_GPL3 = Path(__file__).resolve().parents[3] / "tests" / "data" / "GPL-3"


@dataclass(frozen=True)
class SuiteMember:
    """One text of the evaluation set, as data.

    Attributes:
        name: short identifier (``--suite-members`` picks by it; also the member's plot folder).
        kind: what sort of text it is (``legal prose``, ``source code``, ...).
        locator: how to find the text at run time, ``scheme:argument`` (see :func:`resolve_member`):
            ``file:PATH[|PATH...]`` (first existing file), ``module-source:MODULE`` (the module's source
            file, ``inspect.getsourcefile``), ``package-file:PACKAGE/RELATIVE/PATH`` (a data file inside an
            installed package, found without importing it), ``package-description:DIST`` (the long
            description, i.e. README, in a distribution's installed metadata) or ``pydoc-topics`` (CPython's
            ``pydoc_data.topics.topics``: the language reference, topics joined in sorted key order).
        tokens: tokens of the text to score (the first ones, a BOS the tokenizer adds included); ``kvpage eval
            --tokens`` overrides it.
        version_of: what decides the text's bytes: ``python`` (the interpreter's version) or a distribution
            name whose installed version is recorded (``None``: a system file, no version).
        recorded_version: that version when ``recorded_sha256`` was taken.
        recorded_sha256: hex sha256 of the UTF-8 text resolved on the machine the suite was fixed on.
        held_back: the member nobody tunes on; exactly one per suite (:func:`check_suite`).
        note: why this text (free text, shown in results.json).
    """

    name: str
    kind: str
    locator: str
    tokens: int
    version_of: str | None
    recorded_version: str | None
    recorded_sha256: str
    held_back: bool = False
    note: str = ""


@dataclass(frozen=True)
class ResolvedText:
    """A member's text as found on this machine (from :func:`resolve_member`).

    Attributes:
        member: the :class:`SuiteMember`.
        text: the whole text (str, decoded as UTF-8); the first ``member.tokens`` tokens are scored.
        origin: where it was read: a file path, or ``pydoc_data.topics.topics`` / ``<dist> METADATA``.
        version: the installed version of ``member.version_of`` (``None`` when it has none).
        sha256: hex sha256 of ``text`` encoded as UTF-8.
    """

    member: SuiteMember
    text: str
    origin: str
    version: str | None
    sha256: str

    @property
    def sha256_matches(self) -> bool:
        """Whether the text is byte for byte the one the suite recorded."""
        return self.sha256 == self.member.recorded_sha256

    def mismatch_warning(self) -> str | None:
        """A one-line warning when the text differs from the recorded one (``None`` when it matches)."""
        if self.sha256_matches:
            return None
        m = self.member
        was = f"{m.version_of} {m.recorded_version}" if m.version_of else "the recorded file"
        now = f"{m.version_of} {self.version}" if m.version_of else self.origin
        return (f"suite member {m.name!r}: text sha256 {self.sha256[:16]}... differs from the recorded "
                f"{m.recorded_sha256[:16]}... ({was} then, {now} here); its numbers are not comparable with "
                f"results from the recorded text")

    def to_dict(self) -> dict[str, Any]:
        """The member's identity for ``results.json`` (everything but the text itself)."""
        m = self.member
        return dict(name=m.name, kind=m.kind, locator=m.locator, origin=self.origin, tokens=m.tokens,
                    held_back=m.held_back, version_of=m.version_of, version=self.version,
                    recorded_version=m.recorded_version, text_chars=len(self.text), text_sha256=self.sha256,
                    recorded_sha256=m.recorded_sha256, sha256_matches=self.sha256_matches, note=m.note)


#: The evaluation set (fixed before any format change; do not tune on the held-back member).
SUITE: tuple[SuiteMember, ...] = (
    SuiteMember(
        name="gpl3", kind="legal prose", locator=f"file:/usr/share/common-licenses/GPL-3|{_VENDORED_GPL3}",
        tokens=1024, version_of=None, recorded_version=None,
        recorded_sha256="3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986",
        note="the GNU GPL v3 (Debian base-files, else the repository's verbatim copy); the current defaults "
             "were tuned on its first 1,024 tokens; 7,658 tokens in all"),
    SuiteMember(
        name="argparse", kind="source code", locator="module-source:argparse", tokens=4096,
        version_of="python", recorded_version="3.11.7",
        recorded_sha256="dc1eba8adfdf615986421f981337458ba1072d3e718a0f76e3224940fd74118b",
        note="CPython's argparse.py (Python code, comments and docstrings); the long context: 4,096 of its "
             "22,129 tokens"),
    SuiteMember(
        name="matplotlibrc", kind="configuration file", locator="package-file:matplotlib/mpl-data/matplotlibrc",
        tokens=1024, version_of="matplotlib", recorded_version="3.11.2",
        recorded_sha256="8b76e138ce9dc944a843dc6aa1ef9ee0e88638358b10baf227cd248d271b5f5a",
        note="matplotlib's default rc file: commented key: value settings; 11,637 tokens in all"),
    SuiteMember(
        name="torch_readme", kind="project README (Markdown)", locator="package-description:torch",
        tokens=1024, version_of="torch", recorded_version="2.13.0+cpu",
        recorded_sha256="51a5d8c921a82a36ea72a26f86f8a9334ee8268f499e5a7ad74c5005f98ee0d9",
        note="PyTorch's README from its installed METADATA (Markdown, links, shell snippets; torch is pinned "
             "exactly); 8,848 tokens in all"),
    SuiteMember(
        name="language_reference", kind="technical documentation", locator="pydoc-topics", tokens=2048,
        version_of="python", recorded_version="3.11.7",
        recorded_sha256="71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee",
        held_back=True,
        note="held back: no default was tuned on documentation, it is written by others than every tuning "
             "text, and it ships with every CPython; 2,048 of its 113,108 tokens"),
)


def check_suite(members: Sequence[SuiteMember]) -> None:
    """Validate a suite: unique names, positive token counts, exactly one held-back member.

    Raises:
        ValueError: empty, a repeated name, ``tokens < 2``, or not exactly one held-back member.
    """
    if not members:
        raise ValueError("the suite has no members")
    names = [m.name for m in members]
    if len(set(names)) != len(names):
        raise ValueError(f"suite member names repeat: {names}")
    short = [m.name for m in members if m.tokens < 2]
    if short:
        raise ValueError(f"suite members {short} score fewer than 2 tokens")
    held = [m.name for m in members if m.held_back]
    if len(held) != 1:
        raise ValueError(f"a suite holds back exactly one member, this one {len(held)}: {held}")


def select_members(names: str | None, members: Sequence[SuiteMember] = SUITE) -> list[SuiteMember]:
    """The members named in ``names`` (comma-separated, suite order kept), or all of them for ``None``.

    Raises:
        ValueError: ``names`` is blank or names a member the suite does not have (the message lists them).
    """
    if names is None:
        return list(members)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {m.name for m in members}
    unknown = [n for n in wanted if n not in known]
    if not wanted or unknown:
        raise ValueError(f"unknown suite member(s) {unknown or [names]}; the suite has {', '.join(sorted(known))}")
    return [m for m in members if m.name in wanted]


def _read_utf8(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _package_dir(package: str) -> Path:
    """The folder of an installed top-level package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _version(dist: str | None) -> str | None:
    if dist is None:
        return None
    if dist == "python":
        return platform.python_version()
    return importlib.metadata.version(dist)


def resolve_member(member: SuiteMember) -> ResolvedText:
    """Find ``member``'s text on this machine (see :attr:`SuiteMember.locator`) and hash it.

    Reads files and installed metadata only: no network, no writes. The same package and Python
    versions give the same text (compare :attr:`ResolvedText.sha256` with the recorded one).

    Raises:
        FileNotFoundError: no listed file exists, the module or package is not installed, or a
            distribution has no long description.
        ValueError: an unknown locator scheme, or the text is empty.
    """
    scheme, _, arg = member.locator.partition(":")
    if scheme == "file":
        paths = [Path(p) for p in arg.split("|")]
        found = next((p for p in paths if p.is_file()), None)
        if found is None:
            raise FileNotFoundError(f"suite member {member.name!r}: none of {', '.join(map(str, paths))} exists")
        text, origin = _read_utf8(found), str(found)
    elif scheme == "module-source":
        source = inspect.getsourcefile(importlib.import_module(arg))
        if source is None:
            raise FileNotFoundError(f"suite member {member.name!r}: module {arg} has no source file")
        text, origin = _read_utf8(Path(source)), source
    elif scheme == "package-file":
        package, _, rel = arg.partition("/")
        path = _package_dir(package) / rel
        if not path.is_file():
            raise FileNotFoundError(f"suite member {member.name!r}: {path} does not exist")
        text, origin = _read_utf8(path), str(path)
    elif scheme == "package-description":
        payload = importlib.metadata.metadata(arg).json.get("description")  # the long description (the body)
        if not isinstance(payload, str) or not payload.strip():
            raise FileNotFoundError(f"suite member {member.name!r}: {arg}'s metadata has no description")
        text, origin = payload, f"{arg} METADATA (long description)"
    elif scheme == "pydoc-topics":
        from pydoc_data.topics import topics

        text, origin = "\n\n".join(topics[k] for k in sorted(topics)), "pydoc_data.topics.topics"
    else:
        raise ValueError(f"suite member {member.name!r}: unknown locator scheme {scheme!r}")
    if not text.strip():
        raise ValueError(f"suite member {member.name!r}: {origin} is empty")
    return ResolvedText(member=member, text=text, origin=origin, version=_version(member.version_of),
                        sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())


def member_token_ids(tokenizer: Any, resolved: ResolvedText, num_tokens: int | None = None, *,
                     bos: bool | None = None) -> list[int]:
    """The first ``num_tokens`` (default ``resolved.member.tokens``) token ids of a member's text.

    The whole text is tokenized (:func:`~kvpage.model.encode.encode_text`; ``bos`` as there: ``None`` follows
    the tokenizer, so BOS comes first where it adds one), then cut, so the ids are those of the text, not of
    a truncated string.

    Raises:
        ValueError: the text has fewer tokens than asked for, or fewer than 2 are asked for; ``bos=True`` with a
            tokenizer that has no BOS token.
    """
    n = resolved.member.tokens if num_tokens is None else num_tokens
    if n < 2:
        raise ValueError(f"need at least 2 tokens, got {n}")
    ids = encode_text(tokenizer, resolved.text, bos=bos)
    if len(ids) < n:
        raise ValueError(f"suite member {resolved.member.name!r} ({resolved.origin}) has only {len(ids)} tokens; "
                         f"asked for {n}")
    return ids[:n]
