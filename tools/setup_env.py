"""Create the project's virtual environment and install requirement files into it.

    python3 tools/setup_env.py VENV REQUIREMENTS_FILE...

On a machine whose python3 already has a CUDA build of torch and triton (a GPU machine),
the environment is made with --system-site-packages, and every requirement whose package
is already installed there, at any version, is left alone: torch and triton are reused,
never replaced. Elsewhere the pinned versions are installed. pip's own settings apply, so
PIP_NO_INDEX=1 PIP_FIND_LINKS=wheels/ installs offline.
"""

from pathlib import Path
import re
import site
import subprocess
import sys
import tempfile

CUDA_STACK_CHECK = "import torch, triton; raise SystemExit(torch.version.cuda is None)"


def requirement_lines(paths: list[str]) -> list[str]:
    lines = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                lines.append(line)
    return lines


def installed(python: Path, name: str) -> bool:
    probe = f"import importlib.metadata as m; m.version({name!r})"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def see_packages_of_this_python(python: Path) -> None:
    """Make the new environment see this interpreter's packages.

    --system-site-packages shows only the base interpreter's; when python3 is itself a virtual
    environment (as on our GPU machine), its packages are added through a .pth file.
    """
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    target = subprocess.run([python, "-c", purelib], check=True, capture_output=True, text=True).stdout.strip()
    (Path(target) / "reuse-system-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")


def main(venv: str, *requirement_files: str) -> None:
    reuse = subprocess.run([sys.executable, "-c", CUDA_STACK_CHECK], capture_output=True).returncode == 0
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        # Reusing: the parent's pip serves too, so no ensurepip (which some system Pythons lack).
        flags = ["--system-site-packages", "--without-pip"] if reuse else []
        subprocess.run([sys.executable, "-m", "venv", *flags, venv], check=True)
        if reuse:
            see_packages_of_this_python(python)
    wanted = requirement_lines(list(requirement_files))
    if reuse:
        print("This python3 has a CUDA build of torch and triton: reusing it and every package already installed.")
        wanted = [line for line in wanted if not installed(python, re.split(r"[=<>~!\[ ;]", line)[0])]
    if not wanted:
        return
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(wanted) + "\n")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r", f.name], check=True)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
