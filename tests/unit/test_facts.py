"""Fact parsers (bcm.domain.facts) on recorded output; see tests/data/facts/README.md for provenance."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from bcm.agent.facts import FACT_SCRIPT
from bcm.domain.facts import (
    GpuToolStatus,
    HardwareFacts,
    parse_cpuinfo,
    parse_dmi,
    parse_fact_output,
    parse_ip_json,
    parse_ipmitool_lan,
    parse_lsblk_json,
    parse_lscpu_json,
    parse_lspci,
    parse_meminfo,
    parse_netsys,
    parse_nvidia_smi_csv,
    parse_os_release,
    split_sections,
)

DATA = Path(__file__).parent.parent / "data" / "facts"


def sample(name: str) -> str:
    return (DATA / name).read_text()


def section(name: str, body: str, end: str = "rc=0") -> str:
    return f"@@@ begin {name}\n{body}\n@@@ end {name} {end}\n"


def facts_text(*sections: str) -> str:
    return "@@@ bcm-facts 1\n" + "".join(sections)


# --- the whole report --------------------------------------------------------------------------


def test_real_vm_output_parses_completely() -> None:
    facts = parse_fact_output(sample("vm-debian12.facts"))
    assert facts.warnings == []
    assert facts.format_version == 1
    assert facts.hostname == "vm"
    assert facts.kernel == "6.18.44-fc-v1045"
    assert (facts.cpu.model, facts.cpu.sockets, facts.cpu.cores, facts.cpu.threads) == ("AMD EPYC", 1, 2, 2)
    assert facts.memory_bytes == 24683584 * 1024
    assert [(d.name, d.size_bytes, d.rotational) for d in facts.disks] == [("vda", 274877906944, True)]
    eth0 = next(n for n in facts.nics if n.name == "eth0")
    assert eth0.mac == "02:fc:00:00:00:01"
    assert eth0.physical is True
    assert eth0.speed_mbps is None  # virtio reports -1: unknown, not a speed
    assert eth0.state == "up"
    assert "192.0.2.2/24" in eth0.addresses
    assert "lo" not in {n.name for n in facts.nics}
    assert facts.os.id == "debian" and facts.os.version_id == "12"
    assert facts.gpu_tool is GpuToolStatus.ABSENT
    assert facts.gpus == [] and facts.pci_devices == [] and facts.bmc is None


def test_hgx_node_report_has_gpus_pci_and_bmc() -> None:
    text = facts_text(
        section("hostname", "gpu01"),
        section("lscpu", sample("lscpu-nested-dual-xeon.json")),
        section("lspci", sample("lspci-nnmm-hgx-h100.txt")),
        section("nvidiasmi", sample("nvidia-smi-h100x8.csv")),
        section("ipmilan", sample("ipmitool-lan-print.txt")),
        section("dmi", "sys_vendor=Supermicro\nproduct_name=SYS-821GE-TNHR\nproduct_serial=S4242\n"),
    )
    facts = parse_fact_output(text)
    assert facts.warnings == []
    assert facts.gpu_tool is GpuToolStatus.OK
    assert len(facts.gpus) == 8
    assert len([d for d in facts.nvidia_pci_devices if d.class_id == "0302"]) == 8
    assert facts.bmc_address == "198.18.100.21"
    assert facts.dmi.product_name == "SYS-821GE-TNHR"
    # JSON round trip: stored as a JSON column
    again = HardwareFacts.model_validate_json(facts.model_dump_json())
    assert again == facts
    assert json.loads(facts.model_dump_json())["pci_devices"][3]["is_nvidia"] is True


def test_empty_and_garbage_input_never_raise() -> None:
    for text in ["", "random text\nwith lines\n", "@@@ begin lscpu\n{not json"]:
        facts = parse_fact_output(text)
        assert facts.hostname is None
        assert facts.warnings  # says why it is empty
    assert parse_fact_output("").gpu_tool is GpuToolStatus.NOT_RUN


def test_malformed_section_is_a_warning_and_others_still_parse() -> None:
    text = facts_text(
        section("hostname", "n1"),
        section("lscpu", '{"lscpu": [ {"field": truncated'),
        section("lsblk", '{"blockdevices": 7}'),
        section("meminfo", "MemTotal:       1024 kB"),
    )
    facts = parse_fact_output(text)
    assert facts.hostname == "n1"
    assert facts.memory_bytes == 1024 * 1024
    assert facts.cpu.model is None
    assert facts.disks == []
    assert any(w.startswith("section lscpu: unparseable") for w in facts.warnings)
    assert any(w.startswith("section lsblk: unparseable") for w in facts.warnings)


def test_cpuinfo_fallback_used_when_lscpu_failed() -> None:
    text = facts_text(
        section("lscpu", "", "rc=1"), section("cpuinfo", sample("vm-debian12-proc-cpuinfo.txt"))
    )
    facts = parse_fact_output(text)
    assert facts.cpu.model == "AMD EPYC"
    assert facts.cpu.threads == 2
    assert "section lscpu: exited 1" in facts.warnings


def test_output_cut_off_mid_section_keeps_what_arrived() -> None:
    text = facts_text(section("hostname", "n2")) + "@@@ begin meminfo\nMemTotal: 2048 kB\n"
    facts = parse_fact_output(text)
    assert facts.hostname == "n2"
    assert facts.memory_bytes == 2048 * 1024
    assert any("cut off" in w for w in facts.warnings)


def test_ip_fallback_to_sysfs_table_when_iproute2_has_no_json() -> None:
    text = facts_text(
        section("iplink", "Option -j is unknown", "rc=1"),
        section("ipaddr", "", "rc=1"),
        section(
            "netsys",
            "eth0\taa:bb:cc:00:00:01\tup\t25000\t9000\t1\nlo\t00:00:00:00:00:00\tunknown\t\t65536\t0",
        ),
    )
    [nic] = parse_fact_output(text).nics
    assert (nic.name, nic.mac, nic.speed_mbps, nic.mtu, nic.physical) == (
        "eth0",
        "aa:bb:cc:00:00:01",
        25000,
        9000,
        True,
    )


# --- sections ----------------------------------------------------------------------------------


def test_split_sections_records_status_and_missing_tools() -> None:
    version, sections = split_sections(
        facts_text(section("a", "x\ny"), section("b", "", "missing=ipmitool"), section("c", "err", "rc=9"))
    )
    assert version == 1
    assert sections["a"].text == "x\ny" and sections["a"].ok
    assert sections["b"].missing_tool == "ipmitool" and sections["b"].exit_status is None
    assert sections["c"].exit_status == 9 and not sections["c"].ok


def test_end_marker_for_another_section_is_body_text() -> None:
    _, sections = split_sections("@@@ begin a\n@@@ end b rc=0\nz\n@@@ end a rc=0\n")
    assert sections["a"].text == "@@@ end b rc=0\nz"


# --- CPU, memory, disks ------------------------------------------------------------------------


def test_lscpu_flat_real_sample() -> None:
    cpu = parse_lscpu_json(sample("vm-debian12-lscpu.json"))
    assert (cpu.vendor, cpu.architecture, cpu.numa_nodes) == ("AuthenticAMD", "x86_64", 1)


def test_lscpu_nested_dual_socket() -> None:
    cpu = parse_lscpu_json(sample("lscpu-nested-dual-xeon.json"))
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8480C"
    assert (cpu.sockets, cpu.cores, cpu.threads, cpu.numa_nodes) == (2, 112, 224, 2)


def test_lscpu_arm_clusters_when_sockets_unknown() -> None:
    text = json.dumps(
        {
            "lscpu": [
                {"field": "CPU(s):", "data": "72"},
                {"field": "Socket(s):", "data": "-"},
                {"field": "Cluster(s):", "data": "1"},
                {"field": "Core(s) per cluster:", "data": "72"},
                {"field": "Model name:", "data": "Neoverse-V2"},
            ]
        }
    )
    cpu = parse_lscpu_json(text)
    assert (cpu.model, cpu.sockets, cpu.cores, cpu.threads) == ("Neoverse-V2", 1, 72, 72)


def test_cpuinfo_counts_sockets_and_cores() -> None:
    blocks = []
    for proc in range(8):
        socket_id = proc // 4
        blocks.append(
            f"processor\t: {proc}\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon X\n"
            f"physical id\t: {socket_id}\ncpu cores\t: 2\n"
        )
    cpu = parse_cpuinfo("\n".join(blocks))
    assert (cpu.sockets, cpu.cores, cpu.threads, cpu.model) == (2, 4, 8, "Xeon X")


def test_meminfo() -> None:
    assert parse_meminfo("MemFree: 1 kB\nMemTotal:  24683584 kB\n") == 24683584 * 1024
    assert parse_meminfo("MemFree: 1 kB\n") is None
    assert parse_meminfo("MemTotal: lots\n") is None


def test_lsblk_old_string_format_and_filters() -> None:
    text = json.dumps(
        {
            "blockdevices": [
                {
                    "name": "nvme0n1",
                    "size": "3840755982336",
                    "type": "disk",
                    "model": "SAMSUNG MZQL23T8HCLS-00A07 ",
                    "serial": "S64HNE0T123456",
                    "rota": "0",
                    "tran": "nvme",
                },
                {"name": "loop0", "size": "1000", "type": "loop", "rota": "0"},
                {"name": "zram0", "size": 0, "type": "disk", "rota": False},
                {"name": "sr0", "size": 1073741312, "type": "rom", "rota": True},
            ]
        }
    )
    [disk] = parse_lsblk_json(text)
    assert disk.name == "nvme0n1"
    assert disk.size_bytes == 3840755982336
    assert disk.model == "SAMSUNG MZQL23T8HCLS-00A07"
    assert disk.rotational is False
    assert disk.transport == "nvme"


# --- network, OS, DMI --------------------------------------------------------------------------


def test_ip_json_link_without_addresses() -> None:
    link = json.dumps(
        [
            {"ifname": "lo", "link_type": "loopback"},
            {
                "ifname": "ib0",
                "address": "00:00:10:29:fe:80",
                "mtu": 4092,
                "operstate": "DOWN",
                "link_type": "infiniband",
            },
        ]
    )
    [nic] = parse_ip_json(link)
    assert (nic.name, nic.mtu, nic.state, nic.addresses) == ("ib0", 4092, "down", [])


def test_netsys_rejects_short_rows_and_unknown_speed() -> None:
    nics = parse_netsys("eth0\tx\neth1\t02:00:00:00:00:02\tdown\t-1\t1500\t0\n")
    assert list(nics) == ["eth1"]
    assert nics["eth1"].speed_mbps is None
    assert nics["eth1"].physical is False


def test_os_release_quoting() -> None:
    os_facts = parse_os_release(
        'NAME="Ubuntu"\nVERSION_ID="22.04"\nPRETTY_NAME="Ubuntu 22.04.4 LTS"\nID=ubuntu\n# comment\nBROKEN="x\n'
    )
    assert (os_facts.id, os_facts.name, os_facts.version_id) == ("ubuntu", "Ubuntu", "22.04")
    assert os_facts.pretty_name == "Ubuntu 22.04.4 LTS"


def test_dmi_placeholders_become_none() -> None:
    dmi = parse_dmi(
        "sys_vendor=NVIDIA\nproduct_name=DGXH100\nproduct_serial=To Be Filled By O.E.M.\n"
        "board_vendor=\nunknown_key=x\nbios_version=01.01.03"
    )
    assert (dmi.sys_vendor, dmi.product_name, dmi.product_serial) == ("NVIDIA", "DGXH100", None)
    assert dmi.board_vendor is None and dmi.bios_version == "01.01.03"


# --- PCI, GPUs, BMC ----------------------------------------------------------------------------


def test_lspci_nvidia_devices() -> None:
    devices = parse_lspci(sample("lspci-nnmm-hgx-h100.txt"))
    assert len(devices) == 16
    gpu = next(d for d in devices if d.slot == "0000:18:00.0")
    assert gpu.is_nvidia
    assert (gpu.class_name, gpu.class_id) == ("3D controller", "0302")
    assert (gpu.device_name, gpu.device_id) == ("GH100 [H100 SXM5 80GB]", "2330")
    assert (gpu.subsystem_vendor_id, gpu.subsystem_id, gpu.revision) == ("10de", "16c1", "a1")
    nic = next(d for d in devices if d.vendor_id == "15b3")
    assert not nic.is_nvidia and nic.revision is None and nic.device_id == "1021"
    assert sum(d.is_nvidia for d in devices) == 12  # 8 GPUs + 4 NVSwitches


def test_lspci_skips_unparseable_lines() -> None:
    assert parse_lspci('garbage\n0000:00:00.0 "unterminated\n\n') == []


def test_nvidia_smi_eight_h100() -> None:
    gpus = parse_nvidia_smi_csv(sample("nvidia-smi-h100x8.csv"))
    assert [g.index for g in gpus] == list(range(8))
    first = gpus[0]
    assert first.uuid == "GPU-3f0b9c1e-6a2d-4c1b-9e0f-2b7a1d8c4e51"
    assert first.name == "NVIDIA H100 80GB HBM3"
    assert first.memory_mib == 81559
    assert first.serial == "1652423011234"
    assert first.pci_bus_id == "00000000:18:00.0"
    assert (first.driver_version, first.vbios_version) == ("550.54.15", "96.00.89.00.01")
    assert len({g.uuid for g in gpus}) == 8


def test_nvidia_smi_not_available_fields_and_bad_rows() -> None:
    text = (
        "0, GPU-aaaa, NVIDIA GeForce RTX 4090, 24564, [N/A], 00000000:01:00.0, 535.183.01, 95.02.18.80.5F\n"
        "1, GPU-bbbb, short row\n"
        "x, GPU-cccc, NVIDIA A100, 1, 2, 3, 4, 5\n"
    )
    [gpu] = parse_nvidia_smi_csv(text)
    assert gpu.serial is None and gpu.memory_mib == 24564


def test_nvidia_smi_no_driver_is_classified() -> None:
    text = facts_text(
        section("lspci", sample("lspci-nnmm-hgx-h100.txt")),
        section("nvidiasmi", sample("nvidia-smi-no-driver.txt"), "rc=9"),
    )
    facts = parse_fact_output(text)
    assert facts.gpu_tool is GpuToolStatus.NO_DRIVER
    assert facts.gpu_tool_message is not None and "couldn't communicate" in facts.gpu_tool_message
    assert facts.gpus == []
    assert any("12 NVIDIA PCI devices but nvidia-smi is no_driver" in w for w in facts.warnings)


@pytest.mark.parametrize(
    ("end", "body", "status"),
    [
        ("missing=nvidia-smi", "", GpuToolStatus.ABSENT),
        ("rc=6", "No devices were found", GpuToolStatus.FAILED),
        ("rc=0", "", GpuToolStatus.OK),
    ],
)
def test_nvidia_smi_other_outcomes(end: str, body: str, status: GpuToolStatus) -> None:
    facts = parse_fact_output(facts_text(section("nvidiasmi", body, end)))
    assert facts.gpu_tool is status
    assert facts.gpus == []


def test_ipmitool_lan_print() -> None:
    bmc = parse_ipmitool_lan(sample("ipmitool-lan-print.txt"))
    assert bmc is not None
    assert (bmc.ip_address, bmc.mac, bmc.ip_source) == (
        "198.18.100.21",
        "3c:ec:ef:6a:12:9e",
        "Static Address",
    )
    assert (bmc.subnet_mask, bmc.gateway) == ("255.255.255.0", "198.18.100.1")


def test_ipmitool_unconfigured_or_empty() -> None:
    assert parse_ipmitool_lan("IP Address : 0.0.0.0\nMAC Address : 00:11:22:33:44:55\n").ip_address is None  # type: ignore[union-attr]
    assert parse_ipmitool_lan("Could not open device at /dev/ipmi0\n") is None


# --- the script itself -------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("dash") is None, reason="needs dash to check POSIX sh syntax")
def test_fact_script_is_posix_sh() -> None:
    done = subprocess.run(["dash", "-n", "-c", FACT_SCRIPT], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_fact_script_runs_locally_and_parses() -> None:
    # Pure-stdlib path the agent uses; every section must be present, parsed or marked missing.
    from bcm.agent.facts import collect_local

    _, sections = split_sections(collect_local())
    expected = {
        "hostname",
        "kernel",
        "lscpu",
        "meminfo",
        "lsblk",
        "iplink",
        "ipaddr",
        "netsys",
        "osrelease",
        "dmi",
        "lspci",
        "nvidiasmi",
        "ipmilan",
    }
    assert expected <= set(sections)
    assert all(s.exit_status is not None or s.missing_tool for s in sections.values())


def test_the_facts_model_refuses_control_characters_and_unbounded_values() -> None:
    from pydantic import ValidationError

    from bcm.domain.facts import HardwareFacts

    for bad in (
        {"nics": [{"name": "eth\x000"}]},
        {"dmi": {"sys_vendor": "\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\"}},
        {"memory_bytes": 2**63},
        {"cpu": {"cores": -4}},
        {"pci_devices": [{"slot": "x"}] * 2049},
        {"gpu_tool_message": "nvidia-smi \x07 failed"},
    ):
        with pytest.raises(ValidationError):
            HardwareFacts.model_validate(bad)
    ok = HardwareFacts.model_validate({"gpu_tool_message": "line one\n\tline two", "memory_bytes": 2**63 - 1})
    assert ok.gpu_tool_message == "line one\n\tline two"


def test_parsers_drop_control_characters_and_out_of_range_numbers_so_a_nodes_facts_stay_valid() -> None:
    from bcm.domain.facts import HardwareFacts

    out = "\n".join(
        [
            "@@@ bcm-facts 1",
            "@@@ begin hostname",
            "gpu\x1b[31m01",
            "@@@ end hostname rc=0",
            "@@@ begin dmi",
            "product_name=DGX\x00 H100",
            "@@@ end dmi rc=0",
            "@@@ begin meminfo",
            "MemTotal: " + "9" * 30 + " kB",
            "@@@ end meminfo rc=0",
            "@@@ begin nvidiasmi",
            "NVIDIA-SMI has failed\x1b]0;pwned\x07",
            "@@@ end nvidiasmi rc=9",
        ]
    )
    facts = parse_fact_output(out)
    assert facts.hostname == "gpu[31m01" and facts.dmi.product_name == "DGX H100"
    assert facts.memory_bytes is None
    assert facts.gpu_tool_message == "NVIDIA-SMI has failed]0;pwned"
    HardwareFacts.model_validate(facts.model_dump(mode="json"))  # what the discovery image posts is valid
