"""A user's file given by path loads in every process that unpickles what it defines (rlgraph/user_files.py)."""

import pickle
import sys
from pathlib import Path

import pytest

from rlgraph.user_files import UserFileError, import_file, load_files, loaded_files, unpickle

ENV = '''
class Echo:
    def __init__(self, word="hi"):
        self.word = word
'''


def write(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(text)
    return path


def forget(name: str, path: Path) -> None:
    """This process as a fresh one: the module and its directory gone."""
    sys.modules.pop(name, None)
    if str(path.parent.resolve()) in sys.path:
        sys.path.remove(str(path.parent.resolve()))


def test_a_file_loaded_by_path_rebuilds_in_a_fresh_process_from_the_files_sent_with_it(tmp_path):
    path = write(tmp_path / "elsewhere", "echo_env_a.py", ENV)
    try:
        module = import_file(path)
        files = loaded_files()
        assert files["echo_env_a"] == str(path.resolve()) and str(path.parent.resolve()) in sys.path
        blob = pickle.dumps(module.Echo("bye"))
        forget("echo_env_a", path)  # as a spmd rank or Ray actor starts: neither the module nor its directory
        assert unpickle(blob, files, "rank 1").word == "bye"
        assert sys.modules["echo_env_a"].__file__ == str(path.resolve())
    finally:
        forget("echo_env_a", path)


def test_a_pickle_naming_a_module_this_process_lacks_is_named_with_the_process(tmp_path):
    path = write(tmp_path / "other", "echo_env_b.py", ENV)
    try:
        blob = pickle.dumps(import_file(path).Echo())
    finally:
        forget("echo_env_b", path)
    with pytest.raises(UserFileError, match=r"rank 1 cannot rebuild what the controller sent it: ModuleNotFoundError: "
                                            r".*'echo_env_b'.* \(module 'echo_env_b' imports in the controller, not here\)"):
        unpickle(blob, {}, "rank 1")


@pytest.mark.parametrize("text, expected", [
    (None, r"FileNotFoundError: no file"),                                        # not at that path here
    ("import a_package_only_the_controller_has\n", r"ModuleNotFoundError: No module named 'a_package_only"),
    ("def broken(:\n", r"SyntaxError"),
    ("raise RuntimeError('no GPU on this node')\n", r"RuntimeError: no GPU on this node"),
])
def test_a_file_that_cannot_load_in_another_process_names_the_file_and_the_process(tmp_path, text, expected):
    path = tmp_path / "node" / "bad_env.py"
    if text is not None:
        write(path.parent, path.name, text)
    with pytest.raises(UserFileError, match=rf"rank 3 cannot load {path}.* \(module 'bad_env'.*\): {expected}"):
        load_files({"bad_env": str(path)}, "rank 3")
    assert "bad_env" not in sys.modules  # a half-run module never satisfies a later import
