"""Container images for real nodes, made without Docker or a registry, and their import into containerd.

Contract:

- :func:`write_oci_archive` writes a single-layer OCI image layout as a tar that ``ctr images import``
  accepts, named by the ``io.containerd.image.name`` annotation. Byte-for-byte reproducible (fixed
  mtimes and owners), so the same inputs give the same digests.
- :func:`pause_image` and :func:`busybox_image` return the cached archive of the sandbox image and of
  a small client image (Debian's ``busybox-static``), building it on first use.
- :func:`import_image` imports any OCI or docker-archive tarball (e.g. the runtime image from
  ``hack/build-image.sh``) into a containerd's ``k8s.io`` namespace, where the CRI plugin (and so
  the kubelet) finds it, unpacked for the overlayfs snapshotter.
"""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
import shutil
import subprocess
import tarfile
import tempfile

from zerolayer.cluster import build

PAUSE_IMAGE = "zerolayer.local/pause:1"
BUSYBOX_IMAGE = "zerolayer.local/busybox:1"
CRI_NAMESPACE = "k8s.io"
_PAUSE_SOURCE = pathlib.Path(__file__).with_name("pause.c")
_BUSYBOX = pathlib.Path("/bin/busybox")  # from Debian's busybox-static


class ImageError(RuntimeError):
    """An image could not be built or imported."""


def images_dir() -> pathlib.Path:
    """Where built image archives are cached (beside the binaries; ``ZEROLAYER_CACHE`` moves both)."""
    return build.cache_root() / "images"


def _tarinfo(name: str, *, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, size: int = 0,
             link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, link
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
    return info


def layer_tar(files: dict[str, bytes], symlinks: dict[str, str] | None = None,
              dirs: dict[str, int] | None = None) -> bytes:
    """An uncompressed layer: ``files`` (path -> content, mode 0755), ``symlinks`` (path -> target),
    ``dirs`` (path -> mode). Parent directories are added (0755); entries are sorted."""
    symlinks, dirs = symlinks or {}, dirs or {}
    entries: dict[str, tuple] = {}
    for path in list(files) + list(symlinks) + list(dirs):
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            entries.setdefault("/".join(parts[:i]), ("dir", 0o755))
    for path, mode in dirs.items():
        entries[path.strip("/")] = ("dir", mode)
    for path, target in symlinks.items():
        entries[path.strip("/")] = ("link", target)
    for path, data in files.items():
        entries[path.strip("/")] = ("file", data)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(entries):
            kind, value = entries[name]
            if kind == "dir":
                tar.addfile(_tarinfo(name, kind=tarfile.DIRTYPE, mode=value))
            elif kind == "link":
                tar.addfile(_tarinfo(name, kind=tarfile.SYMTYPE, mode=0o777, link=value))
            else:
                tar.addfile(_tarinfo(name, mode=0o755, size=len(value)), io.BytesIO(value))
    return buf.getvalue()


def write_oci_archive(dest: pathlib.Path, name: str, layer: bytes, config: dict) -> pathlib.Path:
    """Write an OCI image layout tar at ``dest`` holding one image ``name`` (full reference) with one layer.

    ``config`` is the image's runtime config (``Entrypoint``, ``Cmd``, ``Env``, ``User``, ...).
    """
    def blob(data: bytes) -> tuple[str, dict]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        return digest, {"digest": digest, "size": len(data)}

    layer_digest, layer_desc = blob(layer)
    image_config = json.dumps({
        "architecture": "amd64", "os": "linux", "config": config,
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created_by": "zerolayer.cluster.images"}],
    }, sort_keys=True).encode()
    config_digest, config_desc = blob(image_config)
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": dict(config_desc, mediaType="application/vnd.oci.image.config.v1+json"),
        "layers": [dict(layer_desc, mediaType="application/vnd.oci.image.layer.v1.tar")],
    }, sort_keys=True).encode()
    manifest_digest, manifest_desc = blob(manifest)
    index = json.dumps({
        "schemaVersion": 2,
        "manifests": [dict(manifest_desc, mediaType="application/vnd.oci.image.manifest.v1+json",
                           annotations={"io.containerd.image.name": name,
                                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]})],
    }, sort_keys=True).encode()
    members = {
        "oci-layout": b'{"imageLayoutVersion":"1.0.0"}',
        "index.json": index,
        f"blobs/sha256/{config_digest.split(':')[1]}": image_config,
        f"blobs/sha256/{manifest_digest.split(':')[1]}": manifest,
        f"blobs/sha256/{layer_digest.split(':')[1]}": layer,
    }
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in ("blobs", "blobs/sha256"):
            tar.addfile(_tarinfo(path, kind=tarfile.DIRTYPE, mode=0o755))
        for path, data in members.items():
            tar.addfile(_tarinfo(path, size=len(data)), io.BytesIO(data))
    tmp.rename(dest)
    return dest


def pause_image(log=print) -> pathlib.Path:
    """The sandbox image's archive (``PAUSE_IMAGE``): ``pause.c`` compiled static; built once, cached."""
    dest = images_dir() / "pause-1.tar"
    if dest.exists():
        return dest
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise ImageError("no C compiler (gcc) to build the pod sandbox's pause program")
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "pause"
        proc = subprocess.run([cc, "-static", "-Os", "-s", "-o", str(out), str(_PAUSE_SOURCE)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise ImageError(f"building the pause program failed (needs a static libc, libc6-dev):\n{proc.stdout}")
        layer = layer_tar({"pause": out.read_bytes()})
    log(f"built the pause image {PAUSE_IMAGE} into {dest}")
    return write_oci_archive(dest, PAUSE_IMAGE, layer, {"Entrypoint": ["/pause"], "User": "65535:65535"})


def busybox_applets(busybox: pathlib.Path = _BUSYBOX) -> list[str]:
    out = subprocess.run([str(busybox), "--list"], stdout=subprocess.PIPE, text=True, check=True).stdout
    return sorted(a for a in out.split() if a and "/" not in a and a != "busybox")


def busybox_image(log=print) -> pathlib.Path:
    """A small client image (``BUSYBOX_IMAGE``): Debian's static busybox with every applet linked in /bin.

    Entrypoint-free, ``Cmd ["sh"]``; ``nc``, ``httpd`` and ``sleep`` serve tests. Its static ``wget``
    crashes in this image (it has no /etc to speak of): probe with ``nc``. Built once, cached.
    """
    dest = images_dir() / "busybox-1.tar"
    if dest.exists():
        return dest
    if not _BUSYBOX.exists():
        raise ImageError(f"{_BUSYBOX} is missing: install Debian's busybox-static")
    layer = layer_tar({"bin/busybox": _BUSYBOX.read_bytes()},
                      symlinks={f"bin/{a}": "busybox" for a in busybox_applets()},
                      dirs={"tmp": 0o1777, "etc": 0o755, "var/www": 0o755})
    log(f"built the busybox image {BUSYBOX_IMAGE} into {dest}")
    return write_oci_archive(dest, BUSYBOX_IMAGE, layer, {"Cmd": ["sh"], "Env": ["PATH=/bin"]})


def import_image(socket: str | pathlib.Path, archive: str | pathlib.Path, *, ctr: str = "ctr",
                 timeout: float = 600) -> list[str]:
    """Import an OCI-layout or docker-archive tarball into the containerd at ``socket`` (namespace
    ``k8s.io``, unpacked for overlayfs) and return the image names it reported.

    Raises :class:`ImageError` when ``ctr`` fails. Importing the same archive again is harmless.
    """
    proc = subprocess.run(
        [ctr, "--address", str(socket), "--namespace", CRI_NAMESPACE, "images", "import",
         "--snapshotter", "overlayfs", str(archive)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        raise ImageError(f"ctr images import {archive} failed: {proc.stdout.strip()}")
    # ctr prints "unpacking <name> (sha256:...)...done" per image.
    return [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("unpacking ")]
