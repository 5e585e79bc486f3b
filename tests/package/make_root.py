#!/usr/bin/python3
"""Makes a minimal Debian root filesystem out of this machine's own installed packages,
offline, for deb_test.sh: what debootstrap --variant=minbase would install (the
Essential and Priority: required packages), plus the dependency closure of the .deb
files to be tested (their Depends, Pre-Depends and Recommends) and of the packages
named with --with, copied file by file from the dpkg database's file lists, with a dpkg
database of its own that lists exactly those packages. The .deb files themselves are
not installed: the test does that with the root's own dpkg.

Usage: make_root.py ROOT DEB... [--with PACKAGE...]
"""

import argparse
import os
import re
import shutil
import subprocess
import sys

ADMIN = "/var/lib/dpkg"
FIELDS = ["binary:Package", "Package", "Architecture", "db:Status-Abbrev", "Essential", "Priority",
          "Provides", "Pre-Depends", "Depends"]


class Installed:
    """The packages installed on this machine, by name and by what they provide."""

    def __init__(self):
        native = subprocess.run(["dpkg", "--print-architecture"], check=True, capture_output=True,
                                text=True).stdout.strip()
        fmt = "\\t".join("${%s}" % f for f in FIELDS) + "\\n"
        out = subprocess.run(["dpkg-query", "-W", "-f=" + fmt], check=True, capture_output=True, text=True).stdout
        self.packages = {}  # binary name (libc6:amd64) -> fields
        self.by_name = {}   # name -> binary names, native architecture first
        self.provided = {}  # virtual name -> binary names
        for line in out.splitlines():
            values = dict(zip(FIELDS, line.split("\t")))
            if not values["db:Status-Abbrev"].startswith("ii"):
                continue
            if values["Architecture"] not in (native, "all"):
                continue  # a foreign architecture's package never satisfies our dependencies here
            binary = values["binary:Package"]
            self.packages[binary] = values
            self.by_name.setdefault(values["Package"], []).append(binary)
            for item in split_list(values["Provides"]):
                self.provided.setdefault(bare_name(item), []).append(binary)

    def resolve(self, alternatives):
        """The installed package that satisfies one of `alternatives` (first match wins)."""
        for name in alternatives:
            if name in self.by_name:
                return self.by_name[name][0]
        for name in alternatives:
            if name in self.provided:
                return self.provided[name][0]
        return None


def split_list(text):
    return [item.strip() for item in text.split(",") if item.strip()]


def bare_name(item):
    """`libc6 (>= 2.34)`, `python3:any`, `foo [amd64]` -> the package name."""
    return re.split(r"[\s(\[:]", item.strip(), maxsplit=1)[0]


def relations(text):
    """A Depends-style field as a list of alternatives lists of names."""
    return [[bare_name(alt) for alt in group.split("|")] for group in split_list(text)]


def deb_fields(deb):
    out = subprocess.run(["dpkg-deb", "-f", deb, "Package", "Pre-Depends", "Depends", "Recommends"],
                         check=True, capture_output=True, text=True).stdout
    fields = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def closure(installed, seeds, own):
    """Every package needed by `seeds` (lists of alternatives), following Pre-Depends and Depends."""
    chosen = set()
    todo = list(seeds)
    while todo:
        alternatives = todo.pop()
        if any(name in own for name in alternatives):
            continue  # one of the packages under test: the test installs it
        binary = installed.resolve(alternatives)
        if binary is None:
            sys.exit("make_root: no installed package satisfies " + " | ".join(alternatives))
        if binary in chosen:
            continue
        chosen.add(binary)
        fields = installed.packages[binary]
        todo += relations(fields["Pre-Depends"]) + relations(fields["Depends"])
    return chosen


def canonical(path):
    """The path with its directories' symlinks resolved (/bin/sh -> /usr/bin/sh on merged /usr)."""
    head, tail = os.path.split(path)
    return os.path.join(os.path.realpath(head), tail) if tail else os.path.realpath(path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("debs", nargs="+")
    parser.add_argument("--with", dest="extra", nargs="*", default=[])
    args = parser.parse_args()
    root = os.path.abspath(args.root)
    if os.path.exists(root) and os.listdir(root):
        sys.exit(f"make_root: {root} is not empty")
    os.makedirs(root, exist_ok=True)

    installed = Installed()
    debs = [deb_fields(d) for d in args.debs]
    own = {d["Package"] for d in debs}
    seeds = [[name] for name, v in ((b, installed.packages[b]) for b in installed.packages)
             if v["Essential"] == "yes" or v["Priority"] == "required" for name in [v["Package"]]]
    for d in debs:
        seeds += relations(d.get("Pre-Depends", "")) + relations(d.get("Depends", "")) + \
            relations(d.get("Recommends", ""))
    seeds += [[name] for name in args.extra]
    chosen = sorted(closure(installed, seeds, own))

    # The merged-/usr symlinks (/bin -> usr/bin, ...) as this machine has them.
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        if os.path.islink("/" + top):
            os.symlink(os.readlink("/" + top), os.path.join(root, top))

    paths = set()
    for binary in chosen:
        with open(os.path.join(ADMIN, "info", binary + ".list"), encoding="utf-8") as f:
            for line in f:
                path = line.rstrip("\n")
                if path and path != "/." and os.path.lexists(path):
                    paths.add(canonical(path))
    listing = "\0".join(sorted(p.lstrip("/") for p in paths)).encode()
    pack = subprocess.Popen(["tar", "-C", "/", "--no-recursion", "--null", "-T", "-", "-cf", "-"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    unpack = subprocess.Popen(["tar", "-C", root, "--keep-directory-symlink", "-xpf", "-"], stdin=pack.stdout)
    pack.stdout.close()
    pack.stdin.write(listing)
    pack.stdin.close()
    if unpack.wait() != 0 or pack.wait() != 0:
        sys.exit("make_root: copying the packages' files failed")

    # The dpkg database: these packages' status and info files, their diversions and
    # trigger interests; nothing else.
    admin = os.path.join(root, ADMIN.lstrip("/"))
    for sub in ("info", "updates", "triggers", "alternatives", "parts"):
        os.makedirs(os.path.join(admin, sub), exist_ok=True)
    status = subprocess.run(["dpkg-query", "-s"] + chosen, check=True, capture_output=True, text=True).stdout
    with open(os.path.join(admin, "status"), "w", encoding="utf-8") as f:
        f.write(status)
    open(os.path.join(admin, "available"), "w").close()
    open(os.path.join(admin, "statoverride"), "w").close()
    chosen_set = set(chosen)
    for name in os.listdir(os.path.join(ADMIN, "info")):
        # PACKAGE.list, PACKAGE.postinst, ... (a package name may itself hold dots)
        if name.rpartition(".")[0] in chosen_set:
            shutil.copy2(os.path.join(ADMIN, "info", name), os.path.join(admin, "info", name))
    names = {installed.packages[b]["Package"] for b in chosen} | set(chosen)

    def wanted(owner):
        return owner.split("/")[0] in names

    with open(os.path.join(ADMIN, "diversions"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    with open(os.path.join(admin, "diversions"), "w", encoding="utf-8") as f:
        for i in range(0, len(lines) - 2, 3):
            if wanted(lines[i + 2]) or lines[i + 2] == ":":
                f.write("\n".join(lines[i:i + 3]) + "\n")
    triggers = os.path.join(ADMIN, "triggers")
    for name in os.listdir(triggers):
        source = os.path.join(triggers, name)
        if name in ("Lock", "Unincorp") or not os.path.isfile(source):
            open(os.path.join(admin, "triggers", name), "w").close()
            continue
        with open(source, encoding="utf-8") as f:
            kept = [line for line in f.read().splitlines() if line.split() and wanted(line.split()[-1])]
        if kept:
            with open(os.path.join(admin, "triggers", name), "w", encoding="utf-8") as f:
                f.write("\n".join(kept) + "\n")

    # The alternatives (/usr/bin/awk, libblas.so.3, ...) whose current choice is in the root:
    # their links, /etc/alternatives/NAME and update-alternatives' record.
    alternatives = os.path.join(ADMIN, "alternatives")
    for name in os.listdir(alternatives):
        with open(os.path.join(alternatives, name), encoding="utf-8") as f:
            lines = f.read().split("\n")
        if len(lines) < 2:
            continue
        groups = [(name, lines[1])]  # the master: its name and link
        i = 2
        while i + 1 < len(lines) and lines[i]:
            groups.append((lines[i], lines[i + 1]))
            i += 2
        choice = os.path.join("/etc/alternatives", name)
        if not os.path.islink(choice) or not os.path.lexists(root + canonical(os.readlink(choice))):
            continue
        shutil.copy2(os.path.join(alternatives, name), os.path.join(admin, "alternatives", name))
        for group, link in groups:
            selected = os.path.join("/etc/alternatives", group)
            if not os.path.islink(selected) or not os.path.lexists(root + canonical(os.readlink(selected))):
                continue
            for path in (selected, link):
                target = root + canonical(path)
                if os.path.islink(path) and not os.path.lexists(target):
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    os.symlink(os.readlink(path), target)

    # What base-passwd's and base-files' maintainer scripts would have made.
    etc = os.path.join(root, "etc")
    for name in ("passwd", "group"):
        shutil.copyfile(f"/usr/share/base-passwd/{name}.master", os.path.join(etc, name))
    for d in ("tmp", "var/tmp", "proc", "dev", "run", "var/log", "root"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    os.chmod(os.path.join(root, "tmp"), 0o1777)
    os.chmod(os.path.join(root, "var/tmp"), 0o1777)
    print(f"make_root: {len(chosen)} packages, {len(paths)} paths in {root}")


if __name__ == "__main__":
    main()
