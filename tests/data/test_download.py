import hashlib
import io
import tarfile
from dataclasses import replace

import pytest

from longattn.data import download as dl
from longattn.testing import LocalFileServer as _Server


def _tarball() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, content in {"aclImdb/train/pos/0_9.txt": b"good", "aclImdb/README": b"readme" * 500}.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


@pytest.fixture
def fake_archive(monkeypatch):
    data = _tarball()
    archive = dl.Archive("fake", "fake_v1.tar.gz", "https://example.invalid/fake_v1.tar.gz",
                         sha256=hashlib.sha256(data).hexdigest(), md5=hashlib.md5(data).hexdigest(),
                         size=len(data), contents="aclImdb/")
    monkeypatch.setitem(dl.ARCHIVES, "fake", archive)
    return archive, data


def test_download_verify_extract(tmp_path, fake_archive):
    archive, data = fake_archive
    with _Server({archive.filename: data}) as server:
        path = dl.download("fake", tmp_path, base_url=server.url, progress=False)
        assert path.read_bytes() == data
        assert (tmp_path / "aclImdb" / "train" / "pos" / "0_9.txt").read_bytes() == b"good"
        assert not list(tmp_path.glob("*.part")) and not list(tmp_path.glob(".*.extracting"))
        dl.download("fake", tmp_path, base_url=server.url, progress=False)  # present: no second request
        assert server.ranges == [None]


def test_a_tar_is_extracted_whatever_its_name(tmp_path, monkeypatch):
    data = _tarball()  # LRA publishes its gzipped tar as lra_release.gz
    monkeypatch.setitem(dl.ARCHIVES, "release", dl.Archive("release", "release.gz", "https://example.invalid/release.gz",
                                                           sha256=hashlib.sha256(data).hexdigest(), md5=None,
                                                           size=None, contents="aclImdb/"))
    with _Server({"release.gz": data}) as server:
        dl.download("release", tmp_path, base_url=server.url, progress=False)
    assert (tmp_path / "aclImdb" / "train" / "pos" / "0_9.txt").read_bytes() == b"good"


def test_resume_from_partial_file(tmp_path, fake_archive):
    archive, data = fake_archive
    (tmp_path / (archive.filename + ".part")).write_bytes(data[:100])
    with _Server({archive.filename: data}) as server:
        dl.download("fake", tmp_path, base_url=server.url, progress=False, extract=False)
    assert server.ranges == ["bytes=100-"]
    assert (tmp_path / archive.filename).read_bytes() == data


def test_checksum_mismatch_leaves_nothing(tmp_path, fake_archive, monkeypatch):
    archive, data = fake_archive
    corrupted = data[:-1] + bytes([data[-1] ^ 1])
    with _Server({archive.filename: corrupted}) as server:
        with pytest.raises(dl.DownloadError, match="SHA256"):
            dl.download("fake", tmp_path, base_url=server.url, progress=False)
    assert not (tmp_path / archive.filename).exists()
    assert not (tmp_path / (archive.filename + ".part")).exists()  # a bad part is not resumed later
    assert not (tmp_path / "aclImdb").exists()
    md5_only = replace(archive, sha256=None, md5="0" * 32)
    monkeypatch.setitem(dl.ARCHIVES, "fake", md5_only)
    with _Server({archive.filename: data}) as server:
        with pytest.raises(dl.DownloadError, match="MD5"):
            dl.download("fake", tmp_path, base_url=server.url, progress=False)


def test_base_url_from_environment_and_http_errors(tmp_path, fake_archive, monkeypatch):
    archive, data = fake_archive
    with _Server({}) as server:
        monkeypatch.setenv(dl.BASE_URL_ENV, server.url)
        assert dl.archive_url(archive) == server.url + "/" + archive.filename
        with pytest.raises(dl.DownloadError, match="HTTP 404"):
            dl.download("fake", tmp_path, progress=False)
    monkeypatch.delenv(dl.BASE_URL_ENV)
    assert dl.archive_url(archive) == archive.url


def test_unverified_archives_need_consent_and_unknown_names(tmp_path):
    with pytest.raises(dl.DownloadError, match="allow_unverified"):
        dl.download("lra_release", tmp_path)
    with pytest.raises(dl.DownloadError, match="unknown dataset"):
        dl.download("mnist", tmp_path)


def test_extraction_refuses_path_traversal(tmp_path, monkeypatch):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    data = buffer.getvalue()
    archive = dl.Archive("evil", "evil.tar.gz", "https://example.invalid/evil.tar.gz",
                         sha256=hashlib.sha256(data).hexdigest(), md5=None, size=None, contents="")
    monkeypatch.setitem(dl.ARCHIVES, "evil", archive)
    dest = tmp_path / "dest"
    with _Server({archive.filename: data}) as server:
        with pytest.raises(dl.DownloadError, match="cannot extract"):
            dl.download("evil", dest, base_url=server.url, progress=False)
    assert not (tmp_path / "escape.txt").exists()


def test_official_table_is_complete():
    for name in ("imdb", "cifar10", "lra_release"):
        archive = dl.ARCHIVES[name]
        assert archive.url.startswith("https://") and archive.url.endswith(archive.filename)
    assert dl.ARCHIVES["cifar10"].md5 == "c58f30108f718f92721af3b95e74349a"


def test_zip_extraction_and_plain_files(tmp_path, monkeypatch):
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("Task/train.tsv", "a\tb\n")
    good = buffer.getvalue()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("../escape.txt", "x")
    evil = buffer.getvalue()
    plain = b"label\ttext\n"
    for name, filename, data in (("good", "good.zip", good), ("evil", "evil.zip", evil), ("plain", "train.txt", plain)):
        monkeypatch.setitem(dl.ARCHIVES, name, dl.Archive(name, filename, f"https://example.invalid/{filename}",
                                                         sha256=hashlib.sha256(data).hexdigest(), md5=None,
                                                         size=None, contents=""))
    with _Server({"good.zip": good, "evil.zip": evil, "train.txt": plain}) as server:
        dl.download("good", tmp_path / "a", base_url=server.url, progress=False)
        assert (tmp_path / "a" / "Task" / "train.tsv").read_text() == "a\tb\n"
        with pytest.raises(dl.DownloadError, match="cannot extract"):
            dl.download("evil", tmp_path / "b", base_url=server.url, progress=False)
        assert dl.download("plain", tmp_path / "c", base_url=server.url, progress=False).read_bytes() == plain
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "b" / "escape.txt").exists()
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["train.txt"]  # used as it is
