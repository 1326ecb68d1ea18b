"""Triton's system shared-memory extension on a front-end: SystemSharedMemoryStatus, Register and Unregister
(and the CUDA extension's RPCs, with nothing registered), and the regions a request's tensors name.

Off unless ``--allow-client-shm``: every system RPC then answers PERMISSION_DENIED naming the flag. A region is
registered through any front-end and opened by all (the supervisor holds the table and tells each one), under
its owner: the caller's bearer token's digest, so that with ``--auth-token-file`` one token's regions are
invisible to another. The key, the file it names and the region's bounds are checked before the supervisor is
asked; the supervisor checks the owner's limits and names. A front-end started later (a replacement) opens every
region registered then; regions live until unregistered or until the server stops.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterable

from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_server.common.errors import InvalidInput, NotFound, PermissionDenied, Unimplemented
from resnet_server.common.sections import FrontendConfig
from resnet_server.common.shared_regions import RegionLimits, RegionSpec, RegionTable
from resnet_server.frontend.security import presented_token
from resnet_server.frontend.shared_memory import OpenRegions, Region, open_region
from resnet_server.frontend.supervisor_client import SupervisorClient

Metadata = Iterable[tuple[str, str | bytes]] | None


class SharedMemoryService:
    """The RPCs' work (InferenceService answers them with it), and the regions this front-end has open."""

    def __init__(self, control: SupervisorClient, config: FrontendConfig, tokens_on: bool) -> None:
        self.allowed = config.allow_client_shm
        # Encoded images are read whole from a region, to be decoded: no more of them than a request may carry.
        self.most_encoded_bytes = config.network.max_message_mb << 20
        self.regions = OpenRegions()
        self._control, self._tokens_on = control, tokens_on
        limits = RegionLimits(config.max_shm_regions, config.max_shm_mb << 20)
        self._alone = None if control.supervised else RegionTable(limits)  # a front-end run alone keeps its own
        control.on_regions(self.regions.open, self.regions.close)
        for spec in control.regions:
            self.regions.open(spec)

    def owner(self, metadata: Metadata) -> str:
        """Whose regions a call may see: its token's (with tokens), else every client's ("")."""
        if not self._tokens_on:
            return ""
        return hashlib.sha256(presented_token(metadata)).hexdigest()

    def status(self, request: oip.SystemSharedMemoryStatusRequest, metadata: Metadata
               ) -> oip.SystemSharedMemoryStatusResponse:
        self._check_allowed()
        specs = self.regions.of(self.owner(metadata))
        if request.name:
            specs = [spec for spec in specs if spec.name == request.name]
            if not specs:
                raise NotFound(f"no shared-memory region {request.name[:64]!r} is registered")
        status = oip.SystemSharedMemoryStatusResponse.RegionStatus
        return oip.SystemSharedMemoryStatusResponse(regions={
            spec.name: status(name=spec.name, key=spec.key, offset=spec.offset, byte_size=spec.byte_size)
            for spec in specs})

    async def register(self, request: oip.SystemSharedMemoryRegisterRequest, metadata: Metadata) -> None:
        self._check_allowed()
        if not request.name:
            raise InvalidInput("a shared-memory region needs a name")
        spec = RegionSpec(self.owner(metadata), request.name, request.key, request.offset, request.byte_size)
        fd = open_region(spec)  # the key and the file checked here, so that what is wrong comes back at once
        try:
            found = os.fstat(fd)
        finally:
            os.close(fd)
        spec = dataclasses.replace(spec, device=found.st_dev, inode=found.st_ino)
        if self._alone is not None:
            self._alone.add(spec)
            self.regions.open(spec)
        else:
            await self._control.register_region(spec)

    async def unregister(self, request: oip.SystemSharedMemoryUnregisterRequest, metadata: Metadata) -> None:
        self._check_allowed()
        owner = self.owner(metadata)
        if self._alone is not None:
            self.regions.close(self._alone.remove(owner, request.name))
        else:
            await self._control.unregister_region(owner, request.name)

    def region(self, name: str, owner: str) -> Region:
        self._check_allowed()
        return self.regions.find(owner, name)

    def _check_allowed(self) -> None:
        if not self.allowed:
            raise PermissionDenied("client shared memory is off: start the server with --allow-client-shm to let "
                                   "clients on this machine register regions under /dev/shm")

    def close(self) -> None:
        self.regions.close_all()


def cuda_register() -> None:
    raise Unimplemented("CUDA shared memory is not supported by this server; use system shared memory "
                        "(--allow-client-shm) or send tensors in the request")
