"""`make release`: refused without a CHANGELOG section for the version or with uncommitted changes; else the
source archive, the wheel and SHA256SUMS, which `sha256sum -c` checks and pip installs."""

import os
import shutil
import subprocess
import sys
import tarfile

import llmgw
from tests.conftest import ROOT


def release(clone) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw.cli.release"], cwd=clone, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(clone)})


def git(clone, *argv):
    subprocess.run(["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@example.org", *argv],
                   check=True, capture_output=True)


def test_a_release_needs_its_changelog_section_and_a_clean_checkout_and_makes_what_it_lists(tmp_path):
    clone = tmp_path / "llmgw"
    subprocess.run(["git", "clone", "-q", ROOT, str(clone)], check=True, timeout=120)
    shutil.copytree(os.path.join(ROOT, "static", "katex"), clone / "static" / "katex")  # what `make` fetches
    version = llmgw.__version__
    changelog = clone / "CHANGELOG.md"
    text = changelog.read_text()
    if f"## {version}" in text:  # a checkout of a release itself: take its section away to see the refusal
        text = text.replace(f"## {version}", "## Unreleased", 1)
        changelog.write_text(text)
        git(clone, "commit", "-qam", "no section")
    refused = release(clone)
    assert refused.returncode == 1 and f"CHANGELOG.md has no section for {version}" in refused.stderr
    changelog.write_text(text.replace("## Unreleased", f"## {version} (2026-12-06)", 1))
    dirty = release(clone)
    assert dirty.returncode == 1 and "changes not committed" in dirty.stderr and "CHANGELOG.md" in dirty.stderr
    git(clone, "commit", "-qam", f"llmgw {version}")

    made = release(clone)
    assert made.returncode == 0, made.stderr
    dist = clone / "dist"
    names = sorted(os.listdir(dist))
    assert names == ["SHA256SUMS", f"llmgw-{version}-py3-none-any.whl", f"llmgw-{version}.tar.gz"]
    assert subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=dist, capture_output=True).returncode == 0
    with tarfile.open(dist / f"llmgw-{version}.tar.gz") as archive:
        members = set(archive.getnames())
    assert {f"llmgw-{version}/gateway.py", f"llmgw-{version}/templates/base.html",
            f"llmgw-{version}/deploy/systemd/llmgw-gateway.service",
            f"llmgw-{version}/static/katex/katex.min.js"} <= members
    # The wheel installs with nothing else and imports as the version released.
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(dist / f"llmgw-{version}-py3-none-any.whl")], check=True,
                   timeout=300)
    shown = subprocess.run([str(env / "bin" / "python"), "-c", "import llmgw.rules, llmgw; print(llmgw.__version__)"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert shown.stdout.strip() == version, shown.stderr
