"""``python -m meshbook.kernel install``: a Jupyter kernel that loads meshbook at start."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from jupyter_client.kernelspec import KernelSpecManager

KERNEL_NAME = "meshbook"


def kernel_json() -> dict[str, object]:
    return {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                 "--ext=meshbook"],
        "display_name": "Python 3 (meshbook)",
        "language": "python",
        "metadata": {"debugger": True},
    }


def install(user: bool, prefix: str | None) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, KERNEL_NAME)
        os.makedirs(path)
        with open(os.path.join(path, "kernel.json"), "w") as f:
            json.dump(kernel_json(), f, indent=1)
        import ipykernel

        logo_dir = os.path.join(os.path.dirname(ipykernel.__file__), "resources")
        for logo in ("logo-32x32.png", "logo-64x64.png"):
            if os.path.exists(os.path.join(logo_dir, logo)):
                shutil.copy(os.path.join(logo_dir, logo), path)
        return KernelSpecManager().install_kernel_spec(path, KERNEL_NAME, user=user, prefix=prefix)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshbook.kernel")
    sub = parser.add_subparsers(dest="command", required=True)
    inst = sub.add_parser("install", help='install the "Python 3 (meshbook)" kernelspec')
    where = inst.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for this user only")
    where.add_argument("--sys-prefix", action="store_true",
                       help="into this Python environment (sys.prefix)")
    where.add_argument("--prefix", help="under this prefix")
    args = parser.parse_args(argv)
    prefix = sys.prefix if args.sys_prefix else args.prefix
    path = install(user=args.user, prefix=prefix)
    print(f"installed kernelspec {KERNEL_NAME!r} in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
