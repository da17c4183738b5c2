# Sourced by the setup_*.sh scripts: `make_venv DIR` creates the virtualenv DIR (with $PYTHON, default python3)
# unless it exists, and upgrades its pip.
make_venv() {
    if [ ! -x "$1/bin/python" ]; then
        "${PYTHON:-python3}" -m venv "$1"
    fi
    "$1/bin/python" -m pip install --quiet --upgrade pip
}
