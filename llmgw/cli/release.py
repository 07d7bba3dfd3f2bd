"""`make release`: the source archive, the wheel and their checksums, for the version in llmgw/__init__.py.

    python -m llmgw.cli.release [--dest dist]

Refused unless CHANGELOG.md has a section for the version (`## 0.2.0`, a date
after it if you like): a release nobody wrote up is one operators upgrade to
blind. Refused too where the checkout has changes not committed, since the
archive is made from the last commit and the wheel from the files here, and the
two must be the same release.

The source archive (`git archive` of HEAD, with the KaTeX `make` fetched into
static/katex) is what a control-plane machine runs from (deploy/ assumes it
unpacked at /opt/llmgw: the role files, templates, static files); the wheel is the llmgw package alone, what nodes and
the `llmgw` command elsewhere install. `SHA256SUMS` lists both, in the format
`sha256sum -c` checks.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile

import click

import llmgw
from llmgw.cli import wheelhouse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def changelog_section(text: str, version: str) -> bool:
    """Whether TEXT (a CHANGELOG) has a second-level heading for VERSION."""
    return re.search(rf"^## \[?v?{re.escape(version)}\]?(\s|$)", text, re.M) is not None


def _git(*argv: str) -> str:
    run = subprocess.run(["git", "-C", ROOT, *argv], capture_output=True, text=True)
    if run.returncode != 0:
        raise click.ClickException(f"git {' '.join(argv)} failed: {run.stderr.strip()}; a release is made from "
                                   "a git checkout of llmgw")
    return run.stdout


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _archive(path: str, version: str, katex: str) -> None:
    """The last commit's tree as PATH (tar.gz) under llmgw-VERSION/, with KATEX (static/katex, which git
    ignores: `make` fetches it) beside it, so an unpacked release serves what a checkout does."""
    plain = path[:-len(".gz")]
    _git("archive", "--format=tar", f"--prefix=llmgw-{version}/", "-o", plain, "HEAD")
    with tarfile.open(plain, "a") as tar:
        tar.add(katex, arcname=f"llmgw-{version}/static/katex",
                filter=lambda info: None if info.name.endswith("/.installed") else info)
    with open(plain, "rb") as src, gzip.open(path, "wb") as out:
        shutil.copyfileobj(src, out)
    os.unlink(plain)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--dest", default=os.path.join(ROOT, "dist"), show_default=True, help="Where the files go.")
def main(dest: str) -> None:
    """Make the release of the version in llmgw/__init__.py."""
    version = llmgw.__version__
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        if not changelog_section(f.read(), version):
            raise click.ClickException(
                f"CHANGELOG.md has no section for {version}: name what it brings under `## {version}` (the "
                "`## Unreleased` section, renamed, with the date), or raise __version__ in llmgw/__init__.py "
                "and setup.cfg to the version you mean to release")
    # Untracked files under llmgw/ count: the wheel is packed from the folder, the archive from the commit.
    changed = "\n".join(line for line in _git("status", "--porcelain").splitlines()
                        if not line.startswith("??") or line[3:].startswith("llmgw/"))
    if changed.strip():
        raise click.ClickException("the checkout has changes not committed; commit them (or stash them) first, so "
                                   f"the archive and the wheel are the same release:\n{changed.rstrip()}")
    katex = os.path.join(ROOT, "static", "katex")
    if not os.path.exists(os.path.join(katex, ".installed")):
        raise click.ClickException("static/katex is missing, which the chat page serves: `make release` makes it "
                                   "(or `make static/katex/.installed`, with npm)")
    os.makedirs(dest, exist_ok=True)
    archive = os.path.join(dest, f"llmgw-{version}.tar.gz")
    _archive(archive, version, katex)
    try:
        wheel = wheelhouse.pack_llmgw(dest)
    except wheelhouse.WheelhouseError as e:
        raise click.ClickException(str(e)) from None
    sums = os.path.join(dest, "SHA256SUMS")
    with open(sums, "w") as f:
        for path in (archive, wheel):
            f.write(f"{_sha256(path)}  {os.path.basename(path)}\n")
    commit = _git("rev-parse", "--short", "HEAD").strip()
    click.echo(f"llmgw {version} (commit {commit}):", err=True)
    for path in (archive, wheel, sums):
        click.echo(path)
    click.echo(f"check them with: cd {dest} && sha256sum -c SHA256SUMS", err=True)


if __name__ == "__main__":
    sys.exit(main())
