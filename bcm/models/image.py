"""Images: a recipe chain (base OS plus driver/toolkit/WLM layers) built into versioned boot artifacts.

One row per (name, version); ``state`` says how far its build got (``building`` → ``ready`` |
``failed``), ``is_current`` marks the version that nodes of the image get. Artifacts (kernel, initramfs,
root squashfs, manifest) are files under ``<state dir>/images/<name>/<version>/``, each with its size and
sha256 here.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic import Field as PydanticField
from sqlalchemy import BigInteger, Column, Text, UniqueConstraint
from sqlmodel import Field, SQLModel

from bcm.models.base import json_column, ts_column, utcnow


class ImageState(StrEnum):
    BUILDING = "building"  # a build operation is filling its staging directory
    READY = "ready"  # verified and published under the images directory; may be current
    FAILED = "failed"  # the build or its verification failed; nothing was published


class Image(SQLModel, table=True):
    __table_args__ = (UniqueConstraint("name", "version"),)

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, max_length=128)
    version: str = Field(default="1", max_length=64)
    state: str = Field(default=ImageState.BUILDING, max_length=16)
    recipe: str | None = Field(default=None, max_length=256)
    driver_version: str | None = Field(default=None, max_length=64)
    cuda_version: str | None = Field(default=None, max_length=64)
    created_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))
    kernel_version: str | None = Field(default=None, max_length=64)
    layer_key: str | None = Field(default=None, max_length=64)  # sha256 of the top layer's content key
    is_current: bool = Field(default=False, index=True)
    operation_id: int | None = Field(default=None, index=True)
    error: str | None = Field(default=None, sa_column=Column(Text))
    published_at: datetime | None = Field(default=None, sa_column=ts_column())
    manifest: dict[str, Any] | None = Field(default=None, sa_column=json_column())


class ImageArtifact(SQLModel, table=True):
    __table_args__ = (UniqueConstraint("image_id", "kind"),)

    id: int | None = Field(default=None, primary_key=True)
    image_id: int = Field(foreign_key="image.id", index=True, ondelete="CASCADE")
    kind: str = Field(max_length=16)  # kernel | initramfs | rootfs | manifest
    filename: str = Field(max_length=128)
    size: int = Field(sa_column=Column(BigInteger, nullable=False))
    sha256: str = Field(max_length=64)


# ---- API schemas ---------------------------------------------------------------------------------------


class ArtifactPublic(SQLModel):
    kind: str
    filename: str
    size: int
    sha256: str
    url: str


class ImagePublic(SQLModel):
    name: str
    version: str
    state: str
    current: bool
    recipe: str | None
    kernel_version: str | None
    driver_version: str | None
    cuda_version: str | None
    layer_key: str | None
    operation_id: int | None
    error: str | None
    created_at: datetime
    published_at: datetime | None


class ImageDetail(ImagePublic):
    artifacts: list[ArtifactPublic]
    packages: int  # how many dpkg packages the manifest lists
    layers: list[str]


class ImageBuildRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    recipe: str = PydanticField(min_length=1, max_length=63, pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    version: str | None = PydanticField(
        default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"
    )


class ImageBuildStarted(BaseModel):
    name: str
    version: str
    operation_id: int
