#!/usr/bin/python3
"""The mutation suite's runner (docs/testing.md).

Every mutant in tests/mutants/*.mutants is one small source change that breaks a
guarantee or a documented capability, with the tests expected to notice. The runner
copies the tree to a scratch directory (build-mutants/tree; the work tree is never
touched), then for each mutant: builds the targets its tests need unmutated (once per
target; a tree that does not build unmutated is an error of its own), applies the mutant,
rebuilds incrementally, runs its tests with a time bound, and puts the file back.
One JSON line per mutant, then a summary. It fails when a mutant survives, when one no
longer applies ("stale": its lines are not in the file exactly once), or when one does
not build.

Mutant file format: blocks separated by blank lines; within a block,
    mutant: NAME                 unique, kebab-case
    file: PATH                   relative to the repository root
    guards: TEXT                 the guarantee or claim it breaks
    tests: SPEC [SPEC ...]       gtest target[:filter], or ctest:NAME (run through ctest)
    build: TARGET [TARGET ...]   optional: what to build for ctest: specs (default: all)
    timeout: SECONDS             optional: per test (default 300)
    - LINE                       the lines to find, in order (compared without the
    + LINE                       surrounding whitespace); replaced by the + lines,
                                 indented like the first line found
"""
import argparse
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
MUTANT_DIR = ROOT / "tests" / "mutants"
# Headers every layer includes: a change there selects every mutant.
SHARED_PREFIXES = ("src/common/", "include/lockstep/", "src/protocol/messages.h", "CMakeLists.txt", "src/CMakeLists.txt")


class MutantError(Exception):
    pass


def parse_mutants():
    mutants = []
    for path in sorted(MUTANT_DIR.glob("*.mutants")):
        block = []
        lines = path.read_text().splitlines() + [""]
        for number, line in enumerate(lines, 1):
            if line.strip() == "" or line.startswith("#"):
                if block:
                    mutants.append(parse_block(block, path.name))
                    block = []
                continue
            block.append((number, line))
    names = [m["mutant"] for m in mutants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise MutantError("duplicate mutant names: " + ", ".join(duplicates))
    return mutants


def parse_block(block, source):
    m = {"find": [], "replace": [], "timeout": 300, "build": [], "source": source}
    for number, line in block:
        where = f"{source}:{number}"
        if line.startswith("- ") or line == "-":
            m["find"].append(line[2:])
        elif line.startswith("+ ") or line == "+":
            m["replace"].append(line[2:])
        elif ":" in line:
            key, value = (part.strip() for part in line.split(":", 1))
            if key in ("mutant", "file", "guards"):
                m[key] = value
            elif key in ("tests", "build"):
                m[key] = value.split()
            elif key == "timeout":
                m[key] = int(value)
            else:
                raise MutantError(f"{where}: unknown key {key!r}")
        else:
            raise MutantError(f"{where}: cannot read {line!r}")
    for key in ("mutant", "file", "guards", "tests"):
        if key not in m:
            raise MutantError(f"{source}: a mutant without {key!r} (block at line {block[0][0]})")
    if not m["find"]:
        raise MutantError(f"{source}: mutant {m['mutant']} finds no lines")
    return m


def apply(text, m):
    """The file's text with the mutant applied, or None if its lines are not there once."""
    lines = text.split("\n")
    want = [f.strip() for f in m["find"]]
    hits = [i for i in range(len(lines) - len(want) + 1)
            if all(lines[i + k].strip() == want[k] for k in range(len(want)))]
    if len(hits) != 1:
        return None
    i = hits[0]
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    replacement = [indent + r if r.strip() else "" for r in m["replace"]]
    return "\n".join(lines[:i] + replacement + lines[i + len(want):])


def sync_tree(tree):
    """Copies the repository's tracked and unignored files into the scratch tree, only
    those whose content differs (so that an incremental build stays incremental)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if not src.is_file() or rel.startswith("build"):
            continue
        dst = tree / rel
        data = src.read_bytes()
        if dst.is_file() and dst.read_bytes() == data:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
        shutil.copymode(src, dst)


def changed_files(base):
    out = subprocess.run(["git", "diff", "--name-only", base], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise MutantError(f"git diff against {base} failed: {out.stderr.strip()}")
    untracked = subprocess.run(["git", "ls-files", "-o", "--exclude-standard"], cwd=ROOT, capture_output=True,
                               text=True).stdout
    return set(out.stdout.split()) | set(untracked.split())


def default_base():
    """The commit before this submission: the upstream's merge base when there is one,
    otherwise the newest commit made more than 8 hours before HEAD (the commits of one
    working session land together)."""
    upstream = subprocess.run(["git", "merge-base", "HEAD", "@{upstream}"], cwd=ROOT, capture_output=True, text=True)
    if upstream.returncode == 0 and upstream.stdout.strip() != head():
        return upstream.stdout.strip()
    log = subprocess.run(["git", "log", "--format=%H %ct"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    entries = [line.split() for line in log if line.strip()]
    newest = int(entries[0][1])
    for sha, stamp in entries:
        if newest - int(stamp) > 8 * 3600:
            return sha
    return entries[-1][0]


def head():
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


class Build:
    def __init__(self, scratch, cmake_args, jobs):
        self.tree = scratch / "tree"
        self.dir = self.tree / "build"
        self.jobs = jobs
        self.env = dict(os.environ)
        launcher = []
        if shutil.which("ccache"):
            # Shared with the main build when its flags are the same (scripts/test.sh).
            self.env.setdefault("CCACHE_BASEDIR", str(ROOT))
            self.env.setdefault("CCACHE_NOHASHDIR", "1")
            launcher = ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache", "-DCMAKE_C_COMPILER_LAUNCHER=ccache"]
        self.cmake_args = cmake_args + launcher
        self.tests = None
        self.built = set()

    def ensure(self, targets):
        """Builds these targets unmutated, those not built yet; returns the seconds it took."""
        todo = sorted(set(targets) - self.built)
        if not todo or "all" in self.built:
            return 0.0
        started = time.monotonic()
        ok, log = self.build(todo, 3600)
        if not ok:
            print(log, file=sys.stderr)
            raise MutantError("the unmutated scratch tree does not build: " + " ".join(todo))
        self.built.update(todo)
        return time.monotonic() - started

    def prepare(self):
        self.tree.mkdir(parents=True, exist_ok=True)
        sync_tree(self.tree)
        subprocess.run(["cmake", "-S", str(self.tree), "-B", str(self.dir)] + self.cmake_args, check=True,
                       env=self.env, stdout=subprocess.DEVNULL)

    def load_tests(self):
        """The CTests and their commands (ctest lists a command only once its executable is built)."""
        shown = subprocess.run(["ctest", "--test-dir", str(self.dir), "--show-only=json-v1"], check=True,
                               capture_output=True, text=True, env=self.env).stdout
        self.tests = {}
        for t in json.loads(shown)["tests"]:
            if "command" not in t:
                continue  # its executable is not built (yet)
            env = {}
            cwd = str(self.dir)
            for prop in t.get("properties", []):
                if prop["name"] == "ENVIRONMENT":
                    env.update(v.split("=", 1) for v in prop["value"])
                elif prop["name"] == "WORKING_DIRECTORY":
                    cwd = prop["value"]
            self.tests[t["name"]] = {"command": t["command"], "env": env, "cwd": cwd}

    def build(self, targets, timeout):
        cmd = ["cmake", "--build", str(self.dir), "-j", str(self.jobs)]
        for t in targets:
            cmd += ["--target", t]
        try:
            r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False, "build timed out"
        return r.returncode == 0, (r.stdout + r.stderr)[-4000:]

    def run_test(self, spec, timeout):
        """True if the test passed (the mutant survived it)."""
        if spec.startswith("ctest:"):
            cmd = ["ctest", "--test-dir", str(self.dir), "-R", "^" + spec[6:] + "$", "--output-on-failure",
                   "--timeout", str(max(1, int(timeout)))]
            env = self.env
            cwd = str(self.dir)
        else:
            target, _, flt = spec.partition(":")
            if self.tests is None or target not in self.tests:
                self.load_tests()
            if target not in self.tests:
                raise MutantError(f"no test named {target}")
            cmd = list(self.tests[target]["command"])
            if flt:
                cmd.append("--gtest_filter=" + flt)
            env = dict(self.env, **self.tests[target]["env"])
            cwd = self.tests[target]["cwd"]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        except subprocess.TimeoutExpired:
            return False, "timeout"
        if spec.startswith("ctest:") and "No tests were found" in r.stdout + r.stderr:
            raise MutantError(f"no CTest named {spec[6:]}")
        if spec.startswith("ctest:") and "***Timeout" in r.stdout:
            return False, "timeout"
        if not spec.startswith("ctest:") and flt and "[==========] 0 tests from 0 test suites ran" in r.stdout:
            raise MutantError(f"the filter of {spec} selects no test")
        return r.returncode == 0, "failed"


def targets_of(m):
    gtests = [s.partition(":")[0] for s in m["tests"] if not s.startswith("ctest:")]
    if any(s.startswith("ctest:") for s in m["tests"]):
        return gtests + m["build"] if m["build"] else ["all"]
    return gtests


def run_mutant(build, m, build_timeout, deadline=None):
    """Applies, builds, tests and restores one mutant. With a deadline (the budget's end),
    no build or test runs past it: a mutant cut short by it has the status "budget"."""
    started = time.monotonic()
    result = {"mutant": m["mutant"], "file": m["file"], "killed": False, "killed_by": None}
    path = build.tree / m["file"]
    original = path.read_text() if path.is_file() else None
    mutated = apply(original, m) if original is not None else None

    def bounded(limit):
        return limit if deadline is None else min(limit, deadline - time.monotonic())

    if mutated is None:
        result["status"] = "stale"
    else:
        path.write_text(mutated)
        try:
            limit = bounded(build_timeout)
            ok, log = build.build(targets_of(m), limit) if limit > 0 else (False, "build timed out")
            if not ok:
                cut = log == "build timed out" and limit < build_timeout
                result["status"] = "budget" if cut else "build_failed"
                result["log"] = log
            else:
                result["status"] = "survived"
                for spec in m["tests"]:
                    limit = bounded(m["timeout"])
                    passed, why = build.run_test(spec, limit) if limit > 0 else (False, "timeout")
                    if not passed and why == "timeout" and limit < m["timeout"]:
                        result["status"] = "budget"
                        break
                    if not passed:
                        result.update(killed=True, killed_by=spec + (" (timeout)" if why == "timeout" else ""),
                                      status="killed")
                        break
        finally:
            path.write_text(original)
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--all", action="store_true", help="every mutant")
    mode.add_argument("--changed", action="store_true",
                      help="the mutants of the files this submission changed (all when a shared header changed), "
                           "then a rotating sample of the rest while the budget lasts")
    mode.add_argument("--only", nargs="+", metavar="NAME", help="these mutants")
    mode.add_argument("--list", action="store_true", help="list the mutants and check that each applies")
    ap.add_argument("--base", help="with --changed: the commit to compare with (default: see default_base)")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="run no mutant past this many seconds (one cut short counts as not run)")
    ap.add_argument("--scratch", default=str(ROOT / "build-mutants"), help="scratch directory")
    ap.add_argument("--cmake-arg", action="append", default=[], help="passed to cmake (repeatable)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    try:
        mutants = parse_mutants()
    except MutantError as e:
        print(f"mutants: {e}", file=sys.stderr)
        return 2

    if args.list:
        stale = 0
        for m in mutants:
            text = (ROOT / m["file"]).read_text() if (ROOT / m["file"]).is_file() else None
            fits = text is not None and apply(text, m) is not None
            stale += not fits
            print(f"{m['mutant']:48} {m['file']:40} {'' if fits else 'STALE'}")
        print(f"{len(mutants)} mutants, {stale} stale")
        return 1 if stale else 0

    selected = mutants
    note = "all"
    if args.only:
        unknown = set(args.only) - {m["mutant"] for m in mutants}
        if unknown:
            print(f"mutants: unknown: {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        selected = [m for m in mutants if m["mutant"] in args.only]
        note = "only"
    elif args.changed:
        base = args.base or os.environ.get("LOCKSTEP_MUTANTS_BASE") or default_base()
        changed = changed_files(base)
        shared = sorted(f for f in changed if f.startswith(SHARED_PREFIXES))
        # First the mutants of the files changed, then (every mutant is selected when a
        # shared header changed) the others in an order that rotates with HEAD, so that
        # successive submissions under a budget cover the whole suite.
        first = [m for m in mutants if m["file"] in changed]
        key = head()
        rest = sorted((m for m in mutants if m not in first),
                      key=lambda m: hashlib.sha256((key + m["mutant"]).encode()).hexdigest())
        selected = first + rest
        of_changed = {m["mutant"] for m in (mutants if shared else first)}
        note = (f"changed since {base[:12]}: {len(first)} mutant(s) of changed files"
                + (f", every mutant selected ({shared[0]} changed)" if shared else "")
                + ", then the others in rotation")
    print(json.dumps({"mutants": len(mutants), "selected": note}), flush=True)

    cmake_args = args.cmake_arg or ["-DCMAKE_BUILD_TYPE=RelWithDebInfo"]
    cmake_args = cmake_args + ["-DLOCKSTEP_BUILD_TESTBED=OFF", "-DLOCKSTEP_BUILD_BENCH=OFF"]
    build = Build(pathlib.Path(args.scratch), cmake_args, args.jobs)
    started = time.monotonic()
    try:
        build.prepare()
    except subprocess.CalledProcessError as e:
        print(f"mutants: {e}", file=sys.stderr)
        return 2
    prepared = time.monotonic() - started

    results = []
    not_run = []
    for m in selected:
        elapsed = time.monotonic() - started
        mean = (sum(r["seconds"] for r in results) / len(results)) if results else 0
        if args.budget_s and elapsed + mean > args.budget_s:
            not_run.append(m["mutant"])
            continue
        try:
            prepared += build.ensure(targets_of(m))
            r = run_mutant(build, m, build_timeout=1200, deadline=started + args.budget_s if args.budget_s else None)
        except MutantError as e:
            print(f"mutants: {m['mutant']}: {e}", file=sys.stderr)
            return 2
        print(json.dumps({k: r[k] for k in ("mutant", "file", "killed", "killed_by", "seconds", "status")}), flush=True)
        if r["status"] == "budget":
            not_run.append(m["mutant"])  # cut short by the budget: neither killed nor survived
            continue
        results.append(r)
        if r["status"] == "build_failed":
            print(r["log"], file=sys.stderr)

    bad = [r for r in results if r["status"] != "killed"]
    summary = {
        "summary": {
            "mutants": len(mutants),
            "run": len(results),
            "killed": sum(r["killed"] for r in results),
            "survived": [r["mutant"] for r in results if r["status"] == "survived"],
            "stale": [r["mutant"] for r in results if r["status"] == "stale"],
            "build_failed": [r["mutant"] for r in results if r["status"] == "build_failed"],
            "not_run_budget": len(not_run),
            **({"of_changed_not_run": len(of_changed & set(not_run))} if args.changed else {}),
            "prepare_seconds": round(prepared, 1),
            "seconds": round(time.monotonic() - started, 1),
        }
    }
    print(json.dumps(summary), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
