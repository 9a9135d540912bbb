"""Download the official dataset archives: checksum-verified, resumable, atomic, then extracted.

    python -m longattn.data.download imdb ./data            # -> ./data/aclImdb/...
    python -m longattn.data.download cifar10 ./data --base-url http://mirror.example/datasets

A download goes to `<dest>/<file>.part` (resumed with an HTTP Range request when a part exists),
is checked against the known SHA256 and MD5, and only then renamed to `<dest>/<file>`. Extraction
goes to a temporary folder inside dest and is moved into place entry by entry; a marker file
`.<file>.extracted` records a finished extraction. The base URL can be overridden per call or with
the environment variable LONGATTN_DATA_BASE_URL (the file name is appended to it).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tarfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .common import ARCHIVE_ERRORS, DatasetError, check_tar_complete, download_command

BASE_URL_ENV = "LONGATTN_DATA_BASE_URL"


class DownloadError(DatasetError):
    """A download failed or its checksum did not match."""


@dataclass(frozen=True)
class Archive:
    name: str
    filename: str
    url: str
    sha256: str | None  # None: no published checksum we could confirm (see docs/data.md)
    md5: str | None
    size: int | None
    contents: str  # what the archive holds, for the docs and errors


ARCHIVES: dict[str, Archive] = {
    "imdb": Archive("imdb", "aclImdb_v1.tar.gz", "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz",
                    sha256="c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe",
                    md5="7c2ac02c03563afcf9b574c7e56c153a", size=None,
                    contents="aclImdb/{train,test}/{pos,neg,unsup}/ (LRA Text)"),
    "cifar10": Archive("cifar10", "cifar-10-python.tar.gz", "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                       sha256="6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",
                       md5="c58f30108f718f92721af3b95e74349a", size=170_498_071,
                       contents="cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta} (LRA Image)"),
    "lra_release": Archive("lra_release", "lra_release.gz",
                           "https://storage.googleapis.com/long-range-arena/lra_release.gz",
                           sha256=None, md5=None, size=None,
                           contents="lra_release/{listops-1000,tsv_data,pathfinder32,...} (ListOps, Retrieval, Pathfinder)"),
    "cifar100": Archive("cifar100", "cifar-100-python.tar.gz", "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
                        sha256="85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7",
                        md5="eb9058c3a382ffc7106e4002c42a8d85", size=169_001_437,
                        contents="cifar-100-python/{train,test,meta} (Singularformer CIFAR 100)"),
}


def _add(name: str, filename: str, url: str, sha256: str | None, size: int | None, contents: str) -> None:
    ARCHIVES[name] = Archive(name, filename, url, sha256=sha256, md5=None, size=size, contents=contents)


# GLUE (Wang et al. 2018) as its official download script fetches it; SHA256 and sizes as recorded by
# TensorFlow Datasets for the same files (the MRPC files also match the copies in ../shared/data).
_GLUE = "https://dl.fbaipublicfiles.com/glue/data/"
for _name, _file, _sha, _size in [
    ("cola", "CoLA.zip", "f212fcd832b8f7b435fb991f101abf89f96b933ab400603bf198960dfc32cbff", 376_971),
    ("sst2", "SST-2.zip", "d67e16fb55739c1b32cdce9877596db1c127dc322d93c082281f64057c16deaa", 7_439_277),
    ("stsb", "STS-B.zip", "e60a6393de5a8b5b9bac5020a1554b54e3691f9d600b775bd131e613ac179c85", 802_872),
    ("qqp", "QQP-clean.zip", None, None),  # the re-released QQP: no checksum published for it
    ("mnli", "MNLI.zip", "e7c1d896d26ed6caf700110645df426cc2d8ebf02a5ab743d5a5c68ac1c83633", 312_783_507),
    ("qnli", "QNLIv2.zip", "e634e78627a29adaecd4f955359b22bf5e70f2cbd93b493f2d624138a0c0e5f5", 10_627_589),
    ("rte", "RTE.zip", "6bf86de103ecd335f3441bd43574d23fef87ecc695977a63b82d5efb206556ee", 697_150),
]:
    _add(f"glue_{_name}", _file, _GLUE + _file, _sha, _size, f"{_file[:-4]}/{{train,dev,test}}.tsv (GLUE)")
_SENTEVAL = "https://dl.fbaipublicfiles.com/senteval/senteval_data/"
_add("glue_mrpc_train", "msr_paraphrase_train.txt", _SENTEVAL + "msr_paraphrase_train.txt",
     "60a9b09084528f0673eedee2b69cb941920f0b8cd0eeccefc464a98768457f89", 1_047_044, "MRPC source (GLUE)")
_add("glue_mrpc_test", "msr_paraphrase_test.txt", _SENTEVAL + "msr_paraphrase_test.txt",
     "a04e271090879aaba6423d65b94950c089298587d9c084bf9cd7439bd785f784", 441_275, "MRPC source (GLUE)")
_add("glue_mrpc_dev_ids", "dev_ids.tsv", _GLUE + "mrpc_dev_ids.tsv",
     "971d7767d81b997fd9060ade0ec23c4fc31cbb226a55d1bd4a1bac474eb81dc7", 6_222, "MRPC dev pairs (GLUE)")
# Document classification (Singularformer section 4).
_TEXT_GCN = "https://raw.githubusercontent.com/yao8839836/text_gcn/master/data/R8/"
_add("r8_train", "train.txt", _TEXT_GCN + "train.txt",
     "3ed60c905aaa95b96c3fc4afb6d14ad2e20106c59c5b9dda950dcb3075eecfbe", 3_354_423, "R8 train (label<TAB>text)")
_add("r8_test", "test.txt", _TEXT_GCN + "test.txt",
     "2ba368c42e6808bc3dc68b8f7879eb07a2810ed137f0b304e2213b689677e561", 1_195_260, "R8 test (label<TAB>text)")
_add("bbc", "bbc-fulltext.zip", "http://mlg.ucd.ie/files/datasets/bbc-fulltext.zip", None, None,
     "bbc/<class>/<nnn>.txt (BBC News, 2225 documents)")
_add("20news", "20news-bydate.tar.gz", "https://ndownloader.figshare.com/files/5975967",
     "8f1b2514ca22a5ade8fbb9cfa5727df95fa587f4c87b786e15c759fa66d95610", None,
     "20news-bydate-{train,test}/<group>/<id> (20 Newsgroups bydate)")
_SCOPE = "https://scop.berkeley.edu/downloads/scopeseq-2.08/astral-scopedom-seqres-gd-sel-gs-bib-{}-2.08.fa"
for _identity in ("95", "40"):
    _add(f"scope{_identity}", f"astral-scopedom-seqres-gd-sel-gs-bib-{_identity}-2.08.fa",
         _SCOPE.format(_identity), None, None, f"ASTRAL SCOPe 2.08 < {_identity}% identity (FASTA)")


def _digests(path: Path) -> tuple[str, str]:
    sha256, md5 = hashlib.sha256(), hashlib.md5()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha256.update(block)
            md5.update(block)
    return sha256.hexdigest(), md5.hexdigest()


def check_digests(path: str | Path, sha256: str | None = None, md5: str | None = None) -> str:
    """Check a file against expected checksums (None: not checked); returns its SHA256.
    Raises DownloadError on a mismatch."""
    actual_sha256, actual_md5 = _digests(Path(path))
    if sha256 is not None and actual_sha256 != sha256:
        raise DownloadError(f"{path}: SHA256 {actual_sha256} does not match the expected {sha256}")
    if md5 is not None and actual_md5 != md5:
        raise DownloadError(f"{path}: MD5 {actual_md5} does not match the expected {md5}")
    return actual_sha256


def verify(path: str | Path, archive: Archive) -> str:
    """Check a file against the archive's checksums; returns its SHA256."""
    return check_digests(path, archive.sha256, archive.md5)


_VERIFIED: dict[tuple[str, int, int], str] = {}


def verify_known_archive(path: str | Path, archive: Archive) -> None:
    """Check a local copy of a known archive (found under its official file name) against the
    published checksums before it is read; a file is hashed once per process while unchanged."""
    path = Path(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _VERIFIED:
        return
    try:
        _VERIFIED[key] = verify(path, archive)
    except DownloadError as error:
        raise DownloadError(f"{error}: not the official {archive.filename} (damaged or modified); fetch it "
                            f"again (`{download_command(archive.name, path.parent)}`) or give a "
                            "deliberate copy another name") from None


def archive_url(archive: Archive, base_url: str | None = None) -> str:
    base = base_url or os.environ.get(BASE_URL_ENV)
    return archive.url if not base else base.rstrip("/") + "/" + archive.filename


def _fetch(url: str, part: Path, progress: bool, timeout: float) -> None:
    """Download url into `part`, continuing an existing partial file when the server honours Range."""
    offset = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-"} if offset else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as error:
        if error.code == 416 and offset:  # the part is already complete
            return
        raise DownloadError(f"{url}: HTTP {error.code} {error.reason}") from error
    except (urllib.error.URLError, OSError) as error:
        raise DownloadError(f"{url}: {error}") from error
    with response:
        resumed = offset and response.status == 206
        if not resumed:
            offset = 0  # the server sent the whole file: start over
        length = response.headers.get("Content-Length")
        total = offset + int(length) if length is not None else None
        from tqdm import tqdm

        with open(part, "ab" if resumed else "wb") as handle, tqdm(
            total=total, initial=offset, unit="B", unit_scale=True, desc=part.name[: -len(".part")],
            disable=not progress,
        ) as bar:
            try:
                for block in iter(lambda: response.read(1 << 16), b""):
                    handle.write(block)
                    bar.update(len(block))
            except (urllib.error.URLError, OSError) as error:
                raise DownloadError(f"{url}: interrupted after {handle.tell()} bytes ({error}); "
                                    "run again to resume") from error


def download_file(url: str, dest: str | Path, *, sha256: str | None = None, md5: str | None = None,
                  progress: bool = True, timeout: float = 60.0) -> Path:
    """Fetch ``url`` to the file ``dest``: through ``dest.part`` (resumed when one exists), verified
    against the checksums, then renamed, so ``dest`` only ever holds a verified file. An existing
    ``dest`` that verifies is kept; one that does not is downloaded again."""
    dest = Path(dest)
    if dest.exists():
        try:
            check_digests(dest, sha256, md5)
            return dest
        except DownloadError:
            dest.unlink()  # corrupt or outdated copy: replace it with verified bytes
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    _fetch(url, part, progress, timeout)
    try:
        check_digests(part, sha256, md5)
    except DownloadError:
        part.unlink()  # a corrupt part must not be resumed
        raise
    part.replace(dest)
    return dest


def is_archive(path: Path) -> bool:
    """Whether the file ``path`` is extracted after download: a zip or a tar (any compression), told by its
    content, not its name (LRA's ``lra_release.gz`` is a gzipped tar); other files are used as they are."""
    import zipfile

    return zipfile.is_zipfile(path) or tarfile.is_tarfile(path)


def _extract_zip(path: Path, staging: Path) -> None:
    import zipfile

    root = staging.resolve()
    with zipfile.ZipFile(path) as archive:
        for member in archive.infolist():
            target = (staging / member.filename).resolve()
            is_link = (member.external_attr >> 16) & 0o170000 == 0o120000
            if (root not in target.parents and target != root) or is_link:
                raise zipfile.BadZipFile(f"unsafe member {member.filename!r}")
        archive.extractall(staging)


def _extract_tar(path: Path, staging: Path) -> None:
    with tarfile.open(path, "r:*") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(staging, filter="data")  # refuses absolute paths, '..' and links out of dest
        else:  # Python without extraction filters: check member paths ourselves
            root = staging.resolve()
            for member in tar.getmembers():
                target = (staging / member.name).resolve()
                if root not in target.parents and target != root or member.issym() or member.islnk():
                    raise tarfile.TarError(f"unsafe member {member.name!r}")
            tar.extractall(staging)
        check_tar_complete(tar, path)


def _safe_extract(path: Path, dest: Path) -> None:
    import zipfile

    marker = dest / f".{path.name}.extracted"
    if marker.exists():
        return
    staging = dest / f".{path.name}.extracting"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        (_extract_zip if zipfile.is_zipfile(path) else _extract_tar)(path, staging)
    except (*ARCHIVE_ERRORS, zipfile.BadZipFile, DatasetError) as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise DownloadError(f"{path}: cannot extract ({error})") from error
    for entry in staging.iterdir():
        target = dest / entry.name
        if target.exists():
            if target.is_dir() and entry.is_dir():
                shutil.copytree(entry, target, dirs_exist_ok=True)
                continue
            raise DownloadError(f"cannot extract {entry.name}: {target} exists and is not a folder")
        entry.replace(target)
    shutil.rmtree(staging, ignore_errors=True)
    marker.touch()


def download(name: str, dest: str | Path, *, base_url: str | None = None, extract: bool = True,
             progress: bool = True, allow_unverified: bool = False, timeout: float = 60.0) -> Path:
    """Fetch archive `name` into dest (skipped when a verified copy is there) and extract it.

    Archives without a known checksum (lra_release) need allow_unverified=True; their SHA256 is
    printed so it can be recorded. Returns the path of the archive.
    """
    if name not in ARCHIVES:
        raise DownloadError(f"unknown dataset {name!r}; known: {', '.join(ARCHIVES)}")
    archive = ARCHIVES[name]
    if archive.sha256 is None and archive.md5 is None and not allow_unverified:
        raise DownloadError(f"{name}: no published checksum is known for {archive.filename}; "
                            "pass allow_unverified=True (--allow-unverified) to download it anyway")
    dest = Path(dest)
    final = download_file(archive_url(archive, base_url), dest / archive.filename, sha256=archive.sha256,
                          md5=archive.md5, progress=progress, timeout=timeout)
    if archive.sha256 is None:
        print(f"{archive.filename}: SHA256 {check_digests(final)} (no reference checksum to compare with)",
              file=sys.stderr)
    if extract and is_archive(final):
        _safe_extract(final, dest)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m longattn.data.download", description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(ARCHIVES))
    parser.add_argument("dest")
    parser.add_argument("--base-url", default=None, help=f"mirror folder URL (or set {BASE_URL_ENV})")
    parser.add_argument("--no-extract", action="store_true")
    parser.add_argument("--allow-unverified", action="store_true")
    args = parser.parse_args(argv)
    try:
        path = download(args.name, args.dest, base_url=args.base_url, extract=not args.no_extract,
                        allow_unverified=args.allow_unverified)
    except DatasetError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
