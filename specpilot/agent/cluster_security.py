"""Who may talk to the loop's Dask cluster: a scheduler on this machine's loopback, or one elsewhere only over
mutual TLS (`agent.tls`), since Dask runs the pickled functions of any client that reaches it."""

from __future__ import annotations

import dataclasses
import ipaddress
from pathlib import Path

from dask.distributed import Security
from distributed.comm.addressing import parse_address, parse_host_port


@dataclasses.dataclass
class TLSConf:
    """`agent.tls`: PEM files for Dask over TLS (mutual: every scheduler, worker and client presents a
    certificate the CA signed)."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""


def security(tls: TLSConf | dict | None) -> Security | None:
    """Dask's Security for `agent.tls` (None: none); ValueError naming a missing setting or file."""
    if tls is None:
        return None
    tls = tls if isinstance(tls, TLSConf) else TLSConf(**tls)
    files = {k: str(Path(getattr(tls, k)).expanduser()) if getattr(tls, k) else "" for k in ("ca_file", "cert_file",
                                                                                               "key_file")}
    for key, path in files.items():
        if not path:
            raise ValueError(f"agent.tls.{key} is not set: TLS needs ca_file, cert_file and key_file (PEM files)")
        if not Path(path).is_file():
            raise ValueError(f"agent.tls.{key}: no file {path}")
    cert, key = files["cert_file"], files["key_file"]
    return Security(tls_ca_file=files["ca_file"], tls_client_cert=cert, tls_client_key=key, tls_scheduler_cert=cert,
                    tls_scheduler_key=key, tls_worker_cert=cert, tls_worker_key=key, require_encryption=True)


def is_loopback(address: str) -> bool:
    """Whether a Dask address ("tcp://127.0.0.1:8786", "localhost:8786", "tls://[::1]:8786") is on this
    machine only; a host name other than localhost counts as elsewhere."""
    try:
        host, _ = parse_host_port(parse_address(address)[1])
    except (ValueError, TypeError):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_scheduler(address: str, sec: Security | None) -> None:
    """ValueError unless a scheduler at `address` is safe to send work to: on loopback, or over TLS."""
    if is_loopback(address):
        return
    if sec is None:
        raise ValueError(f"agent.scheduler={address!r} is not on this machine, and Dask runs the pickled functions of "
                         f"any client that reaches it: set agent.tls.ca_file/cert_file/key_file and start the "
                         f"scheduler and workers with the same certificates (a tls:// address), or use a "
                         f"scheduler on 127.0.0.1")
    if parse_address(address)[0] != "tls":
        raise ValueError(f"agent.scheduler={address!r}: with agent.tls the scheduler's address is tls://host:port")
