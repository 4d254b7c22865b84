"""Issue 48, move 4 ("modules by concept"): the renames that reach files outside the concept
branch's own, as a script, so that it can be run again on a merged tree.

    python3 dev/concepts.py          # rewrite the tree in place (run from the repository root)
    python3 dev/concepts.py --check  # say what it would change, change nothing

What it does, in this order (each step says what it changed; a pattern it expected and did not
find is an error, and nothing is written):

1. Drops the compatibility lines the concept branch kept for old callers: a line marked
   ``# compat(reshape-3)`` is deleted, or replaced by what follows ``-> `` in its marker.
2. ``RunBoard``'s forwarders go: every call ``<board>.claim(...)``, ``<board>.members(...)``…
   becomes a call of the structure that owns it (``<board>.claims.claim(...)``,
   ``<board>.members.all(...)``…; :data:`FORWARDERS`), the structures take the names the
   forwarders had (``round_log`` → ``rounds``, ``member_log`` → ``members``, ``attempt_log`` →
   ``attempts``, ``incident_log`` → ``incidents``), and the forwarding methods are deleted from
   ``tensorturn/state/board.py``. A receiver is a board when its text ends in ``board`` (``board``,
   ``self.board``, ``world.board``), is a call of ``board(...)`` or ``RunBoard(...)``, or is
   ``self`` inside ``state/board.py``. A forwarder named but not called on a board (passed as a
   function) is an error, for a person to rewrite; one named on the class (``RunBoard.keep`` in a
   docstring, ``monkeypatch.setattr(RunBoard, "finish_attempt", ...)``) names the structure's class
   and method (``Runs.keep``, ``Attempts.finish``).
3. ``Claims`` split (``state/claims.py`` → also ``announcements.py``, ``uploads.py``): calls of an
   announcement or upload-lease method through ``<board>.claims`` (or a name bound to it:
   ``claims = world.board.claims``) go to ``<board>.announcements`` or ``<board>.uploads``;
   ``<board>.claims.forget_stored(...)`` becomes ``<board>.forget_rounds(...)``;
   a ``NAME = Claims(...)`` whose every use is an upload lease's becomes ``UploadLeases``.
4. Import paths: ``tensorturn.recipes.result`` → ``tensorturn.predictor`` (the file moves, with
   ``git mv``; pyproject's layers gain ``predictor`` below ``export``, and the concept map of
   tests/test_architecture.py a line for it), and ``check_contract`` / ``check_fresh`` are
   imported from ``tensorturn.recipes.contract``.
5. Lines the rewrites took over 120 characters are wrapped where :data:`WRAP` knows them, and
   reported otherwise; ``ruff check --fix --select F401,I001`` then drops the imports left unused.

Only ``*.py`` under tensorturn/, tests/, benchmarks/, testbed/, examples/ and pyproject.toml are
read; docs are not touched (the report lists what they should say).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path.cwd()
FOLDERS = ("tensorturn", "tests", "benchmarks", "testbed", "examples")
BOARD_FILE = "tensorturn/state/board.py"
MARK = "# compat(reshape-3)"

# forwarder → (structure, its method)
FORWARDERS: dict[str, tuple[str, str]] = {
    "create": ("runs", "create"), "update_spec": ("runs", "update_spec"), "exists": ("runs", "exists"),
    "state": ("runs", "state"), "is_finished": ("runs", "is_finished"),
    "mark_running": ("runs", "mark_running"), "touch": ("runs", "touch"), "keys": ("runs", "keys"),
    "persist": ("runs", "persist"), "keep": ("runs", "keep"), "forget": ("runs", "forget"),
    "list_runs": ("runs", "list_runs"), "live_specs": ("runs", "live_specs"), "absent": ("runs", "absent"),
    "claim": ("claims", "claim"), "release": ("claims", "release"), "once": ("claims", "once"),
    "claim_shard": ("claims", "claim_shard"), "shard_owners": ("claims", "shard_owners"),
    "unclaimed_shards": ("claims", "unclaimed_shards"),
    "has_round": ("rounds", "has"), "rounds": ("rounds", "all"),
    "mark_phase": ("progress", "mark_phase"), "live": ("progress", "entries"),
    "record_member": ("members", "record"), "update_member": ("members", "update"),
    "member": ("members", "get"), "members": ("members", "all"),
    "add_bytes": ("traffic", "add_bytes"), "add_store_bytes": ("traffic", "add_store_bytes"),
    "add_data_bytes": ("traffic", "add_data_bytes"),
    "begin_attempt": ("attempts", "begin"), "finish_attempt": ("attempts", "finish"),
    "attempts": ("attempts", "all"), "has_succeeded": ("attempts", "has_succeeded"),
    "incident": ("incidents", "add"), "incidents": ("incidents", "all"),
    "warn": ("incidents", "warn"), "warnings": ("incidents", "warnings"),
}
# forwarders whose names no other class here uses: called through anything but a board, a warning
DISTINCT = {"update_spec", "mark_running", "claim_shard", "shard_owners", "unclaimed_shards", "has_round",
            "mark_phase", "record_member", "update_member", "add_bytes", "add_store_bytes", "add_data_bytes",
            "begin_attempt", "finish_attempt", "has_succeeded", "list_runs", "live_specs", "is_finished"}
STRUCTURES = {"runs", "claims", "traffic", "progress", "records", "rounds", "members", "attempts", "incidents",
              "round_log", "member_log", "attempt_log", "incident_log", "announcements", "uploads"}
ATTRIBUTES = {"round_log": "rounds", "member_log": "members", "attempt_log": "attempts", "incident_log": "incidents"}
ANNOUNCEMENTS = {"announce_complete", "await_complete", "announce_global", "await_global"}
UPLOADS = {"hand_over", "refresh_upload", "upload_ended", "uploading", "handed", "take_back", "forget_uploads"}
BOARD_DOC = ("""The board's own job is what spans them: a run finishing (its keys expire, leftovers are pruned),
a resume (the records rebuilt or reopened), and :meth:`RunBoard.describe` — the JSON that
``tensorturn run --json`` and ``status --json`` print. Its other methods are the structures' own,
by their old names, so that a task reads ``board.claim(...)``.""",
             """The board's own job is what spans them: a run finishing (its keys expire, leftovers are pruned),
a resume (the records rebuilt or reopened), and :meth:`RunBoard.describe` — the JSON that
``tensorturn run --json`` and ``status --json`` print. Everything else is the structure's own,
called through it: ``board.claims.claim(...)``, ``board.members.all(...)``.""")


# lines the rewrites take over 120 characters, as they read then → wrapped (one that is not here is
# reported, to be wrapped by hand)
WRAP = {
    '    if board.claims.unclaimed_shards(run_id, r, options(spec).shards) or store.exists(layout.key("global", run_id, r + 1)):\n':  # noqa: E501
    '    if (board.claims.unclaimed_shards(run_id, r, options(spec).shards)\n'
    '            or store.exists(layout.key("global", run_id, r + 1))):\n',
    '    wait_for(lambda: [a for a in board.attempts.all(run_id) if a["task"].startswith("r2/") and a["outcome"] == "running"],\n':  # noqa: E501
    '    wait_for(lambda: [a for a in board.attempts.all(run_id)\n'
    '                      if a["task"].startswith("r2/") and a["outcome"] == "running"],\n',
}


def wrap(path: Path, before: str, text: str, report: list[str]) -> str:
    old = set(before.splitlines())
    out = []
    for line in text.splitlines(keepends=True):
        line = WRAP.get(line, line)
        if len(line.rstrip("\n")) > 120 and line.rstrip("\n") not in old and "\n" not in line.rstrip("\n"):
            report.append(f"{rel(path)}: wrap by hand (over 120 characters): {line.strip()[:60]}…")
        out.append(line)
    return "".join(out)


class Failed(Exception):
    pass


def sources() -> list[Path]:
    out: list[Path] = []
    for folder in FOLDERS:
        out += sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
    return out


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# ---- 1. compatibility lines ---------------------------------------------------------------------

def drop_compat(text: str) -> str:
    if MARK not in text:
        return text
    out = []
    for line in text.splitlines(keepends=True):
        if MARK not in line:
            out.append(line)
            continue
        code, _, rest = line.partition(MARK)
        if rest.startswith(" -> "):
            indent = code[:len(code) - len(code.lstrip())]
            out.append(indent + rest[len(" -> "):].strip() + "\n")
    text = "".join(out)
    text = re.sub(r"\n{3,}(?=\Z)", "\n", text)  # no blank lines left at the end
    return text.rstrip("\n") + "\n" if text.strip() else text


# ---- 2, 3. calls through the board -------------------------------------------------------------

def is_board(node: ast.expr, in_board_file: bool) -> bool:
    text = ast.unparse(node)
    if in_board_file and text == "self":
        return True
    if isinstance(node, ast.Call):
        return ast.unparse(node.func) in ("board", "RunBoard")
    return text == "board" or text.endswith(".board")


def span(lines: list[str], node: ast.Attribute) -> tuple[int, int, int]:
    """(line index, start, end) of ``node``'s attribute name in ``lines``."""
    row = node.end_lineno - 1  # type: ignore[operator]
    end = byte_to_char(lines[row], node.end_col_offset)  # type: ignore[arg-type]
    start = end - len(node.attr)
    if lines[row][start:end] != node.attr:
        raise Failed(f"line {row + 1}: {node.attr!r} not where the parser put it")
    return row, start, end


def byte_to_char(line: str, offset: int) -> int:
    return len(line.encode()[:offset].decode())


def rewrite_calls(path: Path, text: str, report: list[str]) -> str:
    in_board_file = rel(path) == BOARD_FILE
    tree = ast.parse(text, rel(path))
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, int, str]] = []
    called: set[int] = set()
    shifts: dict[int, int] = {}

    def shift(call: ast.Call, by: int) -> None:
        """The call's lines after its first, aligned under its opening parenthesis, move ``by``."""
        row = call.func.end_lineno - 1  # type: ignore[operator]
        paren = byte_to_char(lines[row], call.func.end_col_offset)  # type: ignore[arg-type]
        for later in range(row + 1, call.end_lineno):  # type: ignore[arg-type]
            if len(lines[later]) - len(lines[later].lstrip(" ")) > paren:
                shifts[later] = shifts.get(later, 0) + by

    aliases: dict[str, str] = {}  # a name bound to <board>.claims (``claims = world.board.claims``) → the board
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            pairs = ([(node.targets[0], node.value)] if isinstance(node.targets[0], ast.Name) else
                     list(zip(node.targets[0].elts, node.value.elts))
                     if isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple) else [])
            for target, value in pairs:
                if (isinstance(target, ast.Name) and isinstance(value, ast.Attribute) and value.attr == "claims"
                        and is_board(value.value, in_board_file)):
                    aliases[target.id] = ast.unparse(value.value)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        func = node.func
        called.add(id(func))
        if (isinstance(func.value, ast.Name) and func.value.id in aliases
                and (func.attr in ANNOUNCEMENTS or func.attr in UPLOADS)):
            row = func.value.lineno - 1
            start = byte_to_char(lines[row], func.value.col_offset)
            new = f"{aliases[func.value.id]}.{'announcements' if func.attr in ANNOUNCEMENTS else 'uploads'}"
            edits.append((row, start, start + len(func.value.id), new))
            shift(node, len(new) - len(func.value.id))
            continue
        if func.attr in FORWARDERS and is_board(func.value, in_board_file):
            owner, method = FORWARDERS[func.attr]
            edits.append((*span(lines, func), f"{owner}.{method}"))
            shift(node, len(f"{owner}.{method}") - len(func.attr))
        elif (isinstance(func.value, ast.Attribute) and func.value.attr == "claims"
              and is_board(func.value.value, in_board_file)):
            if func.attr in ANNOUNCEMENTS or func.attr in UPLOADS:
                new = "announcements" if func.attr in ANNOUNCEMENTS else "uploads"
                edits.append((*span(lines, func.value), new))
                shift(node, len(new) - len("claims"))
            elif func.attr == "forget_stored" and not in_board_file:
                row, start, _ = span(lines, func.value)
                row2, _, end = span(lines, func)
                if row != row2:
                    raise Failed(f"{rel(path)}:{row + 1}: claims.forget_stored split over lines")
                edits.append((row, start, end, "forget_rounds"))
                shift(node, len("forget_rounds") - (end - start))
    # (``board.members.all(...)``, on a tree this script has rewritten, names a structure: not that)
    structures = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):  # a forwarder named on a board without a call: a person rewrites it
        if (isinstance(node, ast.Attribute) and id(node) not in called | structures and node.attr in FORWARDERS
                and is_board(node.value, False) and not isinstance(node.ctx, ast.Store)):
            raise Failed(f"{rel(path)}:{node.lineno}: {ast.unparse(node)} is not called: rewrite it by hand")
    for node in ast.walk(tree):  # a board's method called through a name this script cannot tell is a board
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DISTINCT
                and not is_board(node.func.value, in_board_file)
                and ast.unparse(node.func.value).split(".")[-1] not in STRUCTURES):
            report.append(f"{rel(path)}:{node.lineno}: check by hand: {ast.unparse(node.func)}(...)")
    for row, start, end, new in sorted(edits, reverse=True):
        lines[row] = lines[row][:start] + new + lines[row][end:]
    for row, by in shifts.items():
        indent = len(lines[row]) - len(lines[row].lstrip(" "))
        lines[row] = " " * by + lines[row] if by > 0 else lines[row][min(-by, indent):]
    if edits:
        report.append(f"{rel(path)}: {len(edits)} call(s) through the board")
    return "".join(lines)


CLASSES = {"runs": ("runs", "Runs"), "claims": ("claims", "Claims"), "rounds": ("rounds", "Rounds"),
           "progress": ("live", "Progress"), "members": ("members", "Members"), "traffic": ("traffic", "Traffic"),
           "attempts": ("attempts", "Attempts"), "incidents": ("incidents", "Incidents")}


def class_references(path: Path, text: str, report: list[str]) -> str:
    """``RunBoard.<forwarder>`` named on the class — a docstring's :meth: reference, a test's
    monkeypatch of it — names the structure's class and method instead (the import added)."""
    def doc(m: re.Match) -> str:
        if m[3] not in FORWARDERS:
            return m[0]
        owner, method = FORWARDERS[m[3]]
        module, cls = CLASSES[owner]
        return f"{m[1]}tensorturn.state.{module}.{cls}.{method}"

    text = re.sub(r"(:meth:`~?)(tensorturn\.state\.board\.)?RunBoard\.(\w+)", doc, text)
    needed: set[tuple[str, str]] = set()

    def code(m: re.Match) -> str:
        if m[2] not in FORWARDERS:
            return m[0]
        owner, method = FORWARDERS[m[2]]
        module, cls = CLASSES[owner]
        needed.add((module, cls))
        return f"{m[1]}{cls}.{method}" if m[1] == "" else f'{m[1]}{cls}, "{method}"'

    text = re.sub(r'(setattr\()RunBoard, "(\w+)"', code, text)
    text = re.sub(r"()(?<![.\w`])RunBoard\.(\w+)\b(?!`)", code, text)
    for module, cls in sorted(needed):
        line = f"from tensorturn.state.{module} import {cls}"
        if line not in text:
            text, n = re.subn(r"^(\s*)(from tensorturn\.state\.board import RunBoard\n)",
                              lambda m, line=line: m[1] + m[2] + m[1] + line + "\n", text, count=1, flags=re.M)
            if n != 1:
                raise Failed(f"{rel(path)}: names RunBoard's forwarders on the class but does not import RunBoard")
        report.append(f"{rel(path)}: RunBoard.<forwarder> → {cls}")
    return text


def rename_attributes(text: str) -> str:
    for old, new in ATTRIBUTES.items():
        text = re.sub(rf"\.{old}\b", f".{new}", text)
    return text


def drop_forwarders(text: str) -> str:
    """``state/board.py`` without RunBoard's forwarding methods (and the section comments left
    with nothing under them), its docstring saying so."""
    if BOARD_DOC[0] not in text and BOARD_DOC[1] not in text:
        raise Failed(f"{BOARD_FILE}: its docstring's paragraph on forwarders is not as expected")
    text = text.replace(BOARD_DOC[0], BOARD_DOC[1])
    tree = ast.parse(text)
    board = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RunBoard")
    lines = text.splitlines(keepends=True)
    gone: list[tuple[int, int]] = []
    for item in board.body:
        if isinstance(item, ast.FunctionDef) and item.name in FORWARDERS:
            first = min([item.lineno] + [d.lineno for d in item.decorator_list]) - 1
            gone.append((first, item.end_lineno))  # type: ignore[arg-type]
    for first, last in sorted(gone, reverse=True):
        end = last
        while end < len(lines) and not lines[end].strip():
            end += 1
        del lines[first:end]
    out: list[str] = []
    for i, line in enumerate(lines):  # a "# -- section --" comment left with nothing under it goes
        nxt = next((ln for ln in lines[i + 1:] if ln.strip()), "")
        if line.startswith("    # --") and (nxt.startswith("    # --") or not nxt.startswith("    ")):
            continue
        out.append(line)
    return re.sub(r"\n\n\n(?=    \S)", "\n\n", "".join(out))  # one blank line between methods


def uploads_by_name(path: Path, text: str, report: list[str]) -> str:
    """``NAME = Claims(...)`` whose every use is an upload lease's → ``UploadLeases``."""
    for m in list(re.finditer(r"\b(\w+) = Claims\(", text)):
        name = m[1]
        used = set(re.findall(rf"(?<![.\w]){name}\.(\w+)", text))
        if used and used <= UPLOADS:
            text = text.replace(m[0], f"{name} = UploadLeases(")
            report.append(f"{rel(path)}: {name} = Claims(...) → UploadLeases(...)")
    if "UploadLeases(" in text and "import UploadLeases" not in text:
        still = len(re.findall(r"\bClaims\b", text)) > len(re.findall(r"import .*\bClaims\b", text))
        new = "from tensorturn.state.uploads import UploadLeases"
        if still:
            text = re.sub(r"^(\s*)(from tensorturn\.state\.claims import Claims\n)", rf"\1\2\1{new}\n", text, count=1,
                          flags=re.M)
        else:
            text = re.sub(r"from tensorturn\.state\.claims import Claims\b", new, text, count=1)
    return text


# ---- 4. import paths ---------------------------------------------------------------------------

def move_imports(text: str) -> str:
    text = text.replace("tensorturn.recipes.result", "tensorturn.predictor")
    text = re.sub(r"from tensorturn\.recipes\.check import (check_contract, check_fresh|check_fresh, check_contract|"
                  r"check_contract|check_fresh)\b", r"from tensorturn.recipes.contract import \1", text)
    return text.replace("tensorturn.recipes.check.check_contract", "tensorturn.recipes.contract.check_contract")


def layers(text: str) -> str:
    if '"predictor"' in text:
        return text
    line = "    # a run's model loaded, to serve, export or evaluate (Predictor)\n    \"predictor\",\n"
    new, n = re.subn(r'(\n    "export",\n)', lambda m: m[1] + line, text)
    if n != 1:
        raise Failed('pyproject.toml: no "export" layer line to put "predictor" under')
    return new


CONCEPT_LINE = ('    "predictor": "a run\'s model loaded (Predictor): one fused model or a voting ensemble, '
                'for serve and export",\n')


def concept_map(text: str) -> str:
    """tests/test_architecture.py's concept map gains the new part, under ``export``."""
    if '"predictor":' in text:
        return text
    new, n = re.subn(r'(\n    "export": [^\n]*\n)', lambda m: m[1] + CONCEPT_LINE, text)
    if n != 1:
        raise Failed('tests/test_architecture.py: no "export" line in CONCEPTS to put "predictor" under')
    return new


def main(check: bool) -> int:
    report: list[str] = []
    moved = ROOT / "tensorturn/recipes/result.py"
    target = ROOT / "tensorturn/predictor.py"
    changed: dict[Path, str] = {}
    try:
        for path in sources():
            before = path.read_text()
            text = drop_compat(before)
            text = rewrite_calls(path, text, report)
            text = rename_attributes(text)
            text = class_references(path, text, report)
            if rel(path) == BOARD_FILE:
                text = drop_forwarders(text)
            text = uploads_by_name(path, text, report)
            text = move_imports(text)
            text = wrap(path, before, text, report)
            if rel(path) == "tests/test_architecture.py":
                text = concept_map(text)
            if text != before:
                changed[path] = text
        py = ROOT / "pyproject.toml"
        toml = layers(py.read_text())
        if toml != py.read_text():
            changed[py] = toml
        for path, text in changed.items():
            ast.parse(text) if path.suffix == ".py" else None
    except (Failed, SyntaxError) as exc:
        print(f"dev/concepts.py: {exc}; nothing written", file=sys.stderr)
        return 1
    for line in report:
        print(line)
    print(f"{len(changed)} file(s) to change" + (" (--check: none written)" if check else ""))
    if check:
        return 0
    for path, text in changed.items():
        path.write_text(text)
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if Path(ruff).exists():  # the imports the rewrites left unused (RunBoard's signatures' types), sorted
        py = [str(p) for p in changed if p.suffix == ".py"]
        subprocess.run([ruff, "check", "--fix", "--quiet", "--select", "F401,I001", *py], check=False)
    else:
        print("no ruff here: run `ruff check --fix --select F401,I001` on the changed files")
    if moved.exists() and not target.exists():
        if (ROOT / ".git").exists():
            subprocess.run(["git", "mv", str(moved), str(target)], check=True)
        else:  # a copy of the tree, outside git
            moved.rename(target)
        print("moved tensorturn/recipes/result.py to tensorturn/predictor.py")
    return 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv[1:]))
