"""Every program the suite runs comes from `make test`'s own steps, read from the code, so that a tool left
on this machine by another command (wrk by `make bench`) hides nothing. The programs are collected from the
tests, the modules they import, and the bench scripts, scripts and shell scripts they run: each subprocess
call's command (through taskset, nice, `bash -c`), each `shutil.which`, each `os.access(..., X_OK)`, and the
commands of each shell script. Each must be installed by `make tools` or `make browser` (both prerequisites
of `make test`), be a script of a package of requirements.lock in the venv, be on every Debian (Priority:
required, what a `debian:12` image holds), or be one of the prerequisites of `make test` (python3, make)."""

from __future__ import annotations

import ast
import itertools
import os
import re
import shutil
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest

from tests.server import ROOT

# What a fresh machine needs before `make test` (the Makefile's first line): everything else it installs.
PREREQUISITES = {"python3", "make"}
# Programs no make target installs, each with why the suite may still call it.
ELSEWHERE = {"nvidia-smi": "the NVIDIA driver's: bench/run.py asks it the GPU's name only with --device cuda"}
# Scripts the suite reads and never runs, each with why (their programs need not be on this machine).
READ_ONLY = {"scripts/gpu_check.sh": "a lent GPU machine's checks: tests/bench/test_gpu_check.py parses it (bash -n, "
                                     "the bench commands it names) and never runs it"}
# Where a file the code names by a bare file name ("gc_cost.py", "v2_curl.sh") is looked for.
SEARCHED = ("bench", "scripts", "docs", "tests")
_PYTHON = object()  # sys.executable: the venv's interpreter, whose arguments are a module or a script
_RUNNERS = {"run", "Popen", "call", "check_call", "check_output", "create_subprocess_exec"}
# Keyword arguments that hand a command to a helper (tests/server.py's running_service) or a browser.
_COMMAND_KEYWORDS = {"prefix", "command", "cmd", "argv", "executable_path"}


# ---------------------------------------------------------------------------------------------- Python


def _docstrings(nodes: list[ast.AST]) -> set[int]:
    ids = set()
    for node in nodes:
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


class _Module:
    """One Python file: what it runs, what it imports, the files it names."""

    def __init__(self, path: Path):
        self.path = path
        self.tree = ast.parse(path.read_text(), str(path))
        self.nodes = list(ast.walk(self.tree))
        self.parents = {child: node for node in self.nodes for child in ast.iter_child_nodes(node)}
        self.assignments: dict[str, list[tuple[ast.AST | None, ast.AST]]] = defaultdict(list)
        for node in self.nodes:
            if isinstance(node, ast.Assign):
                targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                targets = [node.target.id]
            else:
                continue
            for name in targets:
                self.assignments[name].append((self._scope(node), node.value))

    def _scope(self, node: ast.AST) -> ast.AST | None:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                return node
        return None

    def _assigned(self, name: str, at: ast.AST) -> list[ast.AST]:
        """The values `name` is given in the function around `at` (or its parameter's default), else in
        the functions around that one, else at module level."""
        scope = self._scope(at)
        while True:
            values = [value for where, value in self.assignments.get(name, ()) if where is scope]
            if scope is not None and not values:
                args = scope.args
                positional = [*args.posonlyargs, *args.args]
                defaults = dict(zip([a.arg for a in positional[len(positional) - len(args.defaults):]],
                                    args.defaults, strict=True))
                defaults |= {a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d}
                if name in defaults:
                    values.append(defaults[name])
                elif name in {a.arg for a in [*positional, *args.kwonlyargs]}:
                    return []  # a parameter with no default: its callers' (the keyword rule finds theirs)
            if values or scope is None:
                return values
            scope = self._scope(scope)

    def words(self, node: ast.AST, depth: int = 0) -> list:
        """The values a single word may take: a string, _PYTHON, or None (not known here)."""
        if depth > 8:
            return [None]
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.JoinedStr):  # an f-string: its variable parts unknown
            return ["".join(v.value if isinstance(v, ast.Constant) else "$" for v in node.values)]
        if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.executable":
            return [_PYTHON]
        if isinstance(node, ast.Name):
            return [w for value in self._assigned(node.id, node) for w in self.words(value, depth + 1)] or [None]
        if isinstance(node, ast.IfExp):
            return self.words(node.body, depth + 1) + self.words(node.orelse, depth + 1)
        if isinstance(node, ast.BoolOp):
            return [w for value in node.values for w in self.words(value, depth + 1)]
        if isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            if called in ("str", "shutil.which") and node.args:
                return self.words(node.args[0], depth + 1)
            if called in ("os.environ.get", "os.getenv") and len(node.args) == 2:  # its default
                return self.words(node.args[1], depth + 1)
        return [None]

    def commands(self, node: ast.AST, depth: int = 0) -> list[list]:
        """The word sequences a command expression may be (a list, a tuple, a name given one)."""
        if depth > 8:
            return [[None]]
        if isinstance(node, ast.List | ast.Tuple):
            parts = []
            for element in node.elts:
                if isinstance(element, ast.Starred):
                    parts.append(self.commands(element.value, depth + 1))
                else:
                    parts.append([[w] for w in self.words(element, depth + 1)])
            return [sum(choice, []) for choice in itertools.islice(itertools.product(*parts), 64)]
        if isinstance(node, ast.Name):
            return [c for value in self._assigned(node.id, node) for c in self.commands(value, depth + 1)] or [[None]]
        if isinstance(node, ast.IfExp):
            return self.commands(node.body, depth + 1) + self.commands(node.orelse, depth + 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return [a + b for a in self.commands(node.left, depth + 1) for b in self.commands(node.right, depth + 1)]
        return [[w] for w in self.words(node, depth + 1)]

    def is_sequence(self, node: ast.AST, depth: int = 0) -> bool:
        if isinstance(node, ast.Name) and depth < 8:
            return any(self.is_sequence(value, depth + 1) for value in self._assigned(node.id, node))
        if isinstance(node, ast.IfExp):
            return self.is_sequence(node.body, depth) or self.is_sequence(node.orelse, depth)
        return isinstance(node, ast.List | ast.Tuple)

    def programs(self) -> Iterator[str]:
        # `from subprocess import run`: a bare run() is subprocess's only then (not a test's own helper).
        bare = {a.asname or a.name for node in self.nodes if isinstance(node, ast.ImportFrom)
                and node.module in ("subprocess", "asyncio") for a in node.names}
        for node in self.nodes:
            if not isinstance(node, ast.Call):
                continue
            called = ast.unparse(node.func)
            name = called.rsplit(".", 1)[-1]
            if name in _RUNNERS and (called.startswith(("subprocess.", "asyncio.")) or called in bare) and node.args:
                for command in self.commands(node.args[0]):
                    yield from unwrap(command)
            elif called.startswith("os.exec") and len(node.args) > 1:
                for word in self.words(node.args[0]):
                    yield from unwrap([word])
            elif called == "shutil.which" and node.args:
                yield from (w for w in self.words(node.args[0]) if isinstance(w, str))
            elif called == "os.access" and len(node.args) == 2 and ast.unparse(node.args[1]) == "os.X_OK":
                yield from (Path(w).name for w in self.words(node.args[0]) if isinstance(w, str))
            for keyword in node.keywords:
                # A command is a sequence of words; a path names the program itself (executable_path).
                if keyword.arg in _COMMAND_KEYWORDS and (keyword.arg == "executable_path"
                                                         or self.is_sequence(keyword.value)):
                    for command in self.commands(keyword.value):
                        yield from unwrap(command)

    def imported(self) -> Iterator[Path]:
        """The files of the project this one imports (bench's own modules by their bare names, as
        bench/ and the tests that put it on sys.path import them)."""
        for node in self.nodes:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = self.path.parents[node.level - 1].relative_to(ROOT).as_posix().replace("/", ".")
                    module = f"{base}.{node.module}" if node.module else base
                else:
                    module = node.module
                names = [module] + [f"{module}.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                for base in (ROOT, ROOT / "bench", ROOT / "scripts"):
                    for candidate in (base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py")):
                        if candidate.is_file():
                            yield candidate

    def named(self) -> Iterator[str]:
        """The file names in its strings (not its docstrings): the scripts it may run."""
        docs = _docstrings(self.nodes)
        for node in self.nodes:
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                    and re.fullmatch(r"[\w./-]+\.(py|sh)", node.value):
                yield node.value


# ------------------------------------------------------------------------------------------------ shell

_KEYWORDS = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "!", "{", "}", "time"}
_BUILTINS = {"set", "cd", "echo", "printf", "export", "read", "local", "shift", "exit", "return", "trap", "wait",
             "kill", "test", "[", "[[", "true", "false", ":", "source", ".", "eval", "unset", "break", "continue",
             "declare", "readonly", "type", "hash", "ulimit", "umask", "pwd", "getopts", "let", "alias"}
_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*(\[[^]]*\])?\+?=")


def _skip_to(text: str, i: int, close: str) -> int:
    """The index just past the `close` that ends what starts before `i` (quotes and nesting followed)."""
    depth = 1
    opening = {")": "(", "}": "{"}[close]
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "'":
            i = text.index("'", i + 1)
        elif c == '"':
            i = _skip_quoted(text, i + 1, [])
            continue
        elif c == opening:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"no closing {close!r}")


def _skip_quoted(text: str, i: int, nested: list[str]) -> int:
    """Past the `"` that closes a double-quoted string starting at `i`; its command substitutions appended
    to `nested`."""
    while text[i] != '"':
        if text[i] == "\\":
            i += 2
        elif text.startswith("$((", i):
            i = _skip_to(text, i + 3, ")") + 1
        elif text.startswith("$(", i):
            end = _skip_to(text, i + 2, ")")
            nested.append(text[i + 2:end - 1])
            i = end
        elif text.startswith("${", i):
            i = _skip_to(text, i + 2, "}")
        else:
            i += 1
    return i + 1


def _tokens(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """A shell script's tokens, ("w", word) or ("op", operator), a newline as ";"; and the texts of its
    command substitutions ($(...) and `...`), to be read as scripts of their own. A word keeps a `$`
    where it expands something. Here-documents are skipped."""
    tokens: list[tuple[str, str]] = []
    nested: list[str] = []
    heredocs: list[str] = []
    word: str | None = None
    i, n = 0, len(text)

    def end() -> None:
        nonlocal word
        if word is not None:
            tokens.append(("w", word))
            word = None

    while i < n:
        c = text[i]
        if c == "\\":
            if text[i + 1:i + 2] != "\n":
                word = (word or "") + text[i + 1:i + 2]
            i += 2
        elif c == "#" and word is None:
            i = text.find("\n", i) if "\n" in text[i:] else n
        elif c == "\n":
            end()
            tokens.append(("op", ";"))
            i += 1
            for delimiter in heredocs:  # the here-document's lines, up to its delimiter's
                while i < n:
                    line_end = text.find("\n", i) if "\n" in text[i:] else n
                    line, i = text[i:line_end], line_end + 1
                    if line.strip() == delimiter:
                        break
            heredocs = []
        elif c in " \t":
            end()
            i += 1
        elif c == "'":
            close = text.index("'", i + 1)
            word, i = (word or "") + text[i + 1:close], close + 1
        elif c == '"':
            start = i + 1
            i = _skip_quoted(text, start, nested)
            word = (word or "") + text[start:i - 1]
        elif c == "`":
            close = text.index("`", i + 1)
            nested.append(text[i + 1:close])
            word, i = (word or "") + "$", close + 1
        elif text.startswith("$((", i):
            word, i = (word or "") + "$", _skip_to(text, i + 3, ")") + 1
        elif text.startswith("$(", i):
            close = _skip_to(text, i + 2, ")")
            nested.append(text[i + 2:close - 1])
            word, i = (word or "") + "$", close
        elif text.startswith("${", i):
            word, i = (word or "") + "$", _skip_to(text, i + 2, "}")
        elif text.startswith("$'", i):
            close = i + 2
            while text[close] != "'":
                close += 2 if text[close] == "\\" else 1
            word, i = (word or "") + "$", close + 1
        elif c == "(" and word is not None and word.endswith("="):  # an array's assignment
            word, i = word + "$", _skip_to(text, i + 1, ")")
        elif text.startswith("<<", i) and not text.startswith("<<<", i):
            end()
            match = re.match(r"<<-?\s*(['\"]?)([\w-]+)\1", text[i:])
            heredocs.append(match.group(2))
            i += match.end()
        elif c in "<>":
            if word is not None and word.isdigit():  # a descriptor's number: 2>
                word = None
            end()
            i += 1
            while i < n and text[i] in "<>&":
                i += 1
            tokens.append(("op", "redirect"))
        elif c in ";&|()":
            end()
            two = text[i:i + 2]
            op = two if two in (";;", "&&", "||") else c
            tokens.append(("op", op))
            i += len(op)
        else:
            word = (word or "") + c
            i += 1
    end()
    return tokens, nested


def shell_commands(text: str) -> Iterator[list[str]]:
    """The simple commands of a shell script, each the words from its command name on (assignments before
    it dropped; keywords taken off; case patterns, for lists and function names left out), the commands
    in its substitutions included. Enough of bash for the scripts the tests run."""
    tokens, nested = _tokens(text)
    functions = {tokens[k][1] for k in range(len(tokens) - 2)
                 if tokens[k][0] == "w" and tokens[k + 1] == ("op", "(") and tokens[k + 2] == ("op", ")")}
    command: list[str] = []
    mode = "command"  # or "case" (up to its `in`), "pattern" (up to `)`), "for" (up to the list's end)
    skip_next = False
    for kind, value in tokens:
        if skip_next:  # a redirection's target
            skip_next = False
            continue
        if mode == "case":
            mode = "pattern" if (kind, value) == ("w", "in") else mode
            continue
        if mode == "pattern":
            if (kind, value) == ("w", "esac"):
                mode = "command"
            elif (kind, value) == ("op", ")"):
                mode = "command"
            continue
        if mode == "for":
            mode = "command" if (kind, value) == ("op", ";") else mode
            continue
        if kind == "op":
            if value == "redirect":
                skip_next = True
                continue
            if command:
                yield command
            command = []
            if value == ";;":
                mode = "pattern"
            continue
        if not command:
            if value in _KEYWORDS or (value in functions) or _ASSIGNMENT.match(value):
                continue
            if value == "case":
                mode = "case"
                continue
            if value == "for":
                mode = "for"
                continue
            if value == "esac":
                continue
        command.append(value)
    if command:
        yield command
    for inner in nested:
        yield from shell_commands(inner)


# ----------------------------------------------------------------------------------------------- common


def unwrap(command: list) -> Iterator[str]:
    """The programs a command runs: its first word, and what taskset, nice, timeout, env, exec or
    `bash -c` run in turn. A word not known here, or a variable, ends it."""
    i = 0
    while i < len(command):
        word = command[i]
        if word is None or word is _PYTHON or "$" in word or word.startswith("-"):
            return
        if "/" in word:
            word = Path(word).name
        if word in _BUILTINS:
            return
        if word in ("exec", "command", "builtin", "nohup"):
            if word == "command" and command[i + 1:i + 2] == ["-v"]:
                return
            i += 1
            continue
        yield word
        i += 1
        if word in ("bash", "sh"):
            if command[i:i + 1] == ["-c"] and i + 1 < len(command) and isinstance(command[i + 1], str):
                for inner in shell_commands(command[i + 1]):
                    yield from unwrap(inner)
            return  # a script: read as a file of its own, where the code names it
        if word in ("taskset", "nice", "timeout", "env"):
            while i < len(command) and isinstance(command[i], str) and (
                    command[i].startswith("-") or (word == "env" and _ASSIGNMENT.match(command[i]))):
                takes_value = (word, command[i]) in (("nice", "-n"), ("timeout", "-s"), ("timeout", "-k"))
                i += 2 if takes_value else 1
            if word in ("taskset", "timeout"):
                i += 1  # the mask or the cpu list; the duration
            continue
        return


def _find(name: str) -> list[Path]:
    if (ROOT / name).is_file():
        return [ROOT / name]
    base = Path(name).name
    return [p for folder in SEARCHED for p in (ROOT / folder).rglob(base) if p.is_file()]


@cache
def programs_of_the_suite() -> dict[str, set[str]]:
    """Each program the suite may run, with the files (relative to the checkout) that run it."""
    found: dict[str, set[str]] = defaultdict(set)
    todo = sorted((ROOT / "tests").rglob("*.py"))
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        where = path.relative_to(ROOT).as_posix()
        if where in READ_ONLY:
            continue
        if path.suffix == ".sh":
            for command in shell_commands(path.read_text()):
                for program in unwrap(command):
                    found[program].add(where)
            continue
        module = _Module(path)
        for program in module.programs():
            found[program].add(where)
        todo.extend(module.imported())
        for name in module.named():
            todo.extend(_find(name))
    return dict(found)


# ------------------------------------------------------------------------------------------- the sources


def installed_by_make(dry_run: str) -> set[str]:
    """The programs `make -n tools browser` makes sure of: each recipe line checks for one (`command -v X`,
    `test -x /path/X`) and installs it with apt-get where it is missing."""
    names = set()
    for line in dry_run.replace("\\\n", " ").splitlines():
        checked = re.findall(r"command -v (\S+)", line) + [Path(p).name for p in re.findall(r"test -x (\S+)", line)]
        assert not checked or re.search(r"apt-get (\S+ )*install ", line), f"checked but not installed: {line}"
        names |= set(checked)
    return names


def make_dry_run() -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("ATTEND_CHROMIUM", "ATTEND_SKIP_BROWSER", "MAKEFLAGS")}
    result = subprocess.run(["make", "-n", "tools", "browser"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


def in_the_venv() -> set[str]:
    """The scripts of the venv's packages that requirements.lock pins (what `make install` put there)."""
    locked = {re.split(r"[=<>\[ ]", line)[0].lower().replace("_", "-")
              for line in (ROOT / "requirements.lock").read_text().splitlines() if line and line[0].isalnum()}
    names = set()
    for dist in metadata.distributions():
        if dist.metadata["Name"].lower().replace("_", "-") not in locked:
            continue
        names |= {e.name for e in dist.entry_points if e.group in ("console_scripts", "gui_scripts")}
        names |= {Path(f).name for f in dist.files or () if Path(f).parts[:4] == ("..", "..", "..", "bin")}
    return names


def debian_priority(program: str) -> str | None:
    """The Priority of the Debian package that installed `program` here (None: no package did)."""
    path = shutil.which(program)
    if path is None:
        return None
    candidates = {path, os.path.realpath(path)} | {f"{d}/{program}" for d in ("/bin", "/usr/bin", "/sbin", "/usr/sbin")}
    owners = subprocess.run(["dpkg-query", "-S", *sorted(candidates)], capture_output=True, text=True)
    packages = {package.split(":")[0] for line in owners.stdout.splitlines() if ": /" in line
                and not line.startswith("diversion ") for package in line.split(": /")[0].split(", ")}
    if not packages:
        return None
    priority = subprocess.run(["dpkg-query", "-W", "-f", "${Priority}\n", *sorted(packages)], capture_output=True,
                              text=True).stdout.split()
    return "required" if "required" in priority else (priority[0] if priority else None)


def unaccounted(programs: dict[str, set[str]], from_make: set[str]) -> list[str]:
    """Why each program that none of the sources gives is missing on a fresh machine."""
    venv = in_the_venv()
    problems = []
    for program, where in sorted(programs.items()):
        if program in from_make | venv | PREREQUISITES | set(ELSEWHERE):
            continue
        priority = debian_priority(program)
        if priority != "required":
            had = "not installed here" if priority is None and shutil.which(program) is None else \
                f"here from a Debian package of Priority {priority}" if priority else "here, from no Debian package"
            problems.append(f"{program} (run by {', '.join(sorted(where))}): not installed by `make tools` or "
                            f"`make browser`, not a locked package's script in the venv, not on every Debian ({had})")
    return problems


needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-query") is None,
                                reason="not a Debian machine: which programs every Debian has is told by dpkg")


# ------------------------------------------------------------------------------------------------ tests


def test_make_test_runs_tools_and_browser_first():
    """Every target that runs pytest makes `tools` first: `make test-ray` ran before `make test` in a fresh
    machine's CI, and its bench test found no wrk."""
    makefile = (ROOT / "Makefile").read_text()
    prerequisites = re.search(r"^test:([^#\n]*)", makefile, re.M).group(1).split()
    assert {"install", "tools", "browser"} <= set(prerequisites), prerequisites
    rules = re.findall(r"^([\w-]+):([^#\n]*).*\n((?:\t.*\n)+)", makefile, re.M)
    runners = {target: deps.split() for target, deps, recipe in rules if "-m pytest" in recipe}
    assert {"test", "test-ray"} <= set(runners), runners
    assert all("tools" in deps for deps in runners.values()), runners


@needs_dpkg
def test_every_program_the_suite_runs_is_installed_by_make_test():
    problems = unaccounted(programs_of_the_suite(), installed_by_make(make_dry_run()))
    assert not problems, "\n".join(problems)


@needs_dpkg
def test_the_check_names_a_program_the_recipes_leave_out():
    """wrk taken out of `make tools`' recipe: the check names it (a leftover wrk on this machine or not)."""
    programs = programs_of_the_suite()
    dry_run = make_dry_run()
    assert "wrk" in installed_by_make(dry_run)
    without = "\n".join(line for line in dry_run.replace("\\\n", " ").splitlines() if "wrk" not in line)
    [problem] = unaccounted(programs, installed_by_make(without))
    assert problem.startswith("wrk (run by ") and "bench/loadgen.py" in problem, problem


def test_each_read_only_script_is_one_the_suite_names():
    """READ_ONLY holds no stale entry: each a script of the checkout a test names, its programs left out."""
    named = {Path(n).name for path in (ROOT / "tests").rglob("*.py") for n in _Module(path).named()}
    programs = programs_of_the_suite()
    for script in READ_ONLY:
        assert (ROOT / script).is_file() and Path(script).name in named, script
        assert not any(script in where for where in programs.values()), script


def test_the_programs_are_read_from_the_code():
    """The collector finds the programs known to be run, each where it is run, and nothing that is a
    word of a command rather than its program (a case pattern, an option, a function of the script)."""
    programs = programs_of_the_suite()
    expected = {"wrk": "bench/loadgen.py", "strace": "tests/service/test_server_process.py",
                "promtool": "tests/deploy/test_prometheus.py", "chromium": "tests/web/conftest.py",
                "curl": "docs/examples/v2_curl.sh", "py-spy": "tests/server.py", "taskset": "bench/run.py",
                "make": "tests/test_install.py", "dpkg-deb": "bench/perf_analyzer.sh"}
    for program, where in expected.items():
        assert where in programs.get(program, ()), (program, programs.get(program))
    script = set(itertools.chain.from_iterable(unwrap(c) for c in shell_commands(
        (ROOT / "bench" / "perf_analyzer.sh").read_text())))
    assert {"apt-get", "dpkg-deb", "curl", "taskset", "awk", "sed", "mktemp", "seq", "install"} <= script, script
    assert not script & {"perf_analyzer", "http", "grpc", "python3", "cleanup", "EOF", "json"}, script
    assert list(shell_commands("case $1 in\n  a|b) x=1; shift ;;\n  *) grep -q y <<'EOF'\nnot a command\nEOF\n"
                               "    ;;\nesac\nfor f in one two; do sed -n p \"$(dirname \"$f\")\"; done >/dev/null\n"
                               "A=1 B=$(awk 1 /x) nice -n 5 taskset -c 1 wrk -t1 2>&1 | tee out\n")) == [
        ["shift"], ["grep", "-q", "y"], ["sed", "-n", "p", '$(dirname "$f")'],
        ["nice", "-n", "5", "taskset", "-c", "1", "wrk", "-t1"], ["tee", "out"], ["dirname", "$f"], ["awk", "1", "/x"]]
    assert [list(unwrap(c)) for c in shell_commands("exec nice -n 5 taskset -c 1 wrk\nbash -c 'curl x; cd /'\n"
                                                     "command -v strace\n")] == [["nice", "taskset", "wrk"],
                                                                                  ["bash", "curl"], []]
