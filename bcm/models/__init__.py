"""SQLModel tables and API schemas, one module per aggregate. Importing this registers every table."""

from bcm.models.auth import ApiToken, Role, User
from bcm.models.category import Category
from bcm.models.event import Event
from bcm.models.gpu import Gpu
from bcm.models.ha import Leader, Server
from bcm.models.health import GpuHealth, HealthEvent, HealthRecord, NodeHealth
from bcm.models.image import Image, ImageArtifact
from bcm.models.node import Interface, Node
from bcm.models.operation import Operation, OpState
from bcm.models.pxe import BootToken, PxeConfig
from bcm.models.tenancy import Department, DepartmentAdmin, Project, ProjectMember
from bcm.models.wlm import WlmCluster

__all__ = [
    "ApiToken",
    "BootToken",
    "Category",
    "Department",
    "DepartmentAdmin",
    "Event",
    "Gpu",
    "GpuHealth",
    "HealthEvent",
    "HealthRecord",
    "Image",
    "ImageArtifact",
    "Interface",
    "Leader",
    "Node",
    "NodeHealth",
    "OpState",
    "PxeConfig",
    "Operation",
    "Project",
    "ProjectMember",
    "Role",
    "Server",
    "User",
    "WlmCluster",
]
