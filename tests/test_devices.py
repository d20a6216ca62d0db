"""ddprun.devices: CUDA_VISIBLE_DEVICES, --gpus, the inventory probes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from ddprun import devices
from ddprun.devices import (
    DEVICE_ORDER_ENV,
    Gpu,
    VisibleGpu,
    describe_gpu,
    hides_all_gpus,
    parse_inventory_csv,
    read_driver_version,
    read_inventory,
    select_gpus,
    visible_devices_value,
    visible_gpus,
)
from ddprun.errors import DdprunError, UsageError
from gpu_stub import FOUR_GPUS, install_stub_nvidia_smi, path_with

INVENTORY = [Gpu(index=i, uuid=u, name=n, memory_mib=m) for i, u, n, m in FOUR_GPUS]
UUID0, UUID1, UUID2, UUID3 = (gpu.uuid for gpu in INVENTORY)  # UUID0 and UUID2 share "GPU-8f"
MIG_NEW = "MIG-d9a47cfb-d1f2-d08c-b40e-0812b597ae69"


def usage_error(function, *args, **kwargs) -> UsageError:
    with pytest.raises(UsageError) as caught:
        function(*args, **kwargs)
    assert caught.value.exit_code == 2
    return caught.value


def indices(visible: list[VisibleGpu]) -> list[int]:
    return [v.gpu.index for v in visible]


# --- visible_gpus: what CUDA exposes -------------------------------------------------


def test_unset_exposes_the_whole_inventory_named_by_index():
    visible = visible_gpus(None, INVENTORY)
    assert visible == [VisibleGpu(entry=str(g.index), gpu=g) for g in INVENTORY]


@pytest.mark.parametrize("value", ["", " ", "-1", " -1 "])
def test_empty_and_minus_one_expose_nothing(value):
    assert visible_gpus(value, INVENTORY) == []
    assert hides_all_gpus(value)


def test_hides_all_gpus_is_false_for_unset_and_real_lists():
    assert not hides_all_gpus(None)
    assert not hides_all_gpus("0")


def test_indices_keep_the_order_written():
    visible = visible_gpus("2,0", INVENTORY)
    assert [v.entry for v in visible] == ["2", "0"]
    assert indices(visible) == [2, 0]


def test_whitespace_around_entries_is_tolerated():
    visible = visible_gpus(" 1 , 3 ", INVENTORY)
    assert [v.entry for v in visible] == ["1", "3"]
    assert indices(visible) == [1, 3]


def test_one_trailing_comma_is_tolerated():
    assert indices(visible_gpus("0,1,", INVENTORY)) == [0, 1]


def test_full_uuid_and_unique_prefix_and_mixed_forms():
    assert indices(visible_gpus(UUID3, INVENTORY)) == [3]
    assert indices(visible_gpus("GPU-8f2a", INVENTORY)) == [0]
    visible = visible_gpus("GPU-1b, 3", INVENTORY)
    assert [v.entry for v in visible] == ["GPU-1b", "3"]
    assert indices(visible) == [1, 3]


def test_ambiguous_uuid_prefix_lists_the_candidates():
    error = usage_error(visible_gpus, "GPU-8f", INVENTORY)
    assert error.message.startswith('CUDA_VISIBLE_DEVICES="GPU-8f": GPU-8f is ambiguous, it matches 2 GPUs')
    assert UUID0 in error.message and UUID2 in error.message
    assert UUID1 not in error.message
    assert "unique prefix" in error.hint


def test_unknown_uuid():
    error = usage_error(visible_gpus, "0,GPU-dead", INVENTORY)
    assert error.message.startswith('CUDA_VISIBLE_DEVICES="0,GPU-dead": GPU-dead matches no GPU on this machine')
    assert "only 0" in error.hint


def test_uuid_in_the_wrong_case_suggests_the_right_one():
    error = usage_error(visible_gpus, "GPU-8F2A", INVENTORY)
    assert "matches no GPU" in error.message
    assert error.hint == f"Did you mean {UUID0}? UUIDs are case-sensitive."


def test_new_style_mig_id_is_kept_without_a_gpu():
    assert visible_gpus(MIG_NEW, INVENTORY) == [VisibleGpu(entry=MIG_NEW, gpu=None)]


def test_old_style_mig_id_is_matched_to_its_parent_gpu():
    first, second = f"MIG-{UUID2}/1/0", f"MIG-{UUID2}/2/0"
    visible = visible_gpus(f"{first},{second}", INVENTORY)
    assert [v.entry for v in visible] == [first, second]  # two instances of one GPU are two devices
    assert indices(visible) == [2, 2]


def test_old_style_mig_id_with_an_unknown_parent():
    error = usage_error(visible_gpus, "MIG-GPU-dead/1/0", INVENTORY)
    assert "GPU-dead matches no GPU" in error.message


def test_same_mig_id_twice_is_a_repeat():
    error = usage_error(visible_gpus, f"{MIG_NEW},{MIG_NEW}", INVENTORY)
    assert f"entry {MIG_NEW} is repeated" in error.message


@pytest.mark.parametrize(
    ("value", "shown", "exposed"),
    [
        ("abc", '"abc"', "no GPU"),
        ("0,abc", '"abc"', "only 0"),
        ("1.5", '"1.5"', "no GPU"),
        ("0,-2", '"-2"', "only 0"),
        ("+1", '"+1"', "no GPU"),
        ("0 1", '"0 1"', "no GPU"),
        ("GPU-", '"GPU-"', "no GPU"),
        ("GPU-xyz", '"GPU-xyz"', "no GPU"),
        ("MIG-", '"MIG-"', "no GPU"),
        ("MIG-GPU-8f2a", '"MIG-GPU-8f2a"', "no GPU"),
        ("MIG-GPU-8f2a/1", '"MIG-GPU-8f2a/1"', "no GPU"),
    ],
)
def test_malformed_entries_are_errors(value, shown, exposed):
    error = usage_error(visible_gpus, value, INVENTORY)
    assert error.message == (
        f'CUDA_VISIBLE_DEVICES="{value}": entry {shown} is not a GPU index, GPU-<uuid> or MIG-<uuid>: '
        f"CUDA would stop reading there and expose {exposed}"
    )
    assert "nvidia-smi" in error.hint


@pytest.mark.parametrize(("value", "exposed"), [("0,,1", "only 0"), (",0", "no GPU"), (",", "no GPU")])
def test_empty_entries_are_errors(value, exposed):
    error = usage_error(visible_gpus, value, INVENTORY)
    assert error.message == (
        f'CUDA_VISIBLE_DEVICES="{value}" has an empty entry: CUDA would stop reading there and expose {exposed}'
    )


def test_minus_one_inside_a_list_explains_that_cuda_stops_there():
    error = usage_error(visible_gpus, "0,-1,1", INVENTORY)
    assert error.message == (
        'CUDA_VISIBLE_DEVICES="0,-1,1": entry -1 makes CUDA ignore it and every entry after it, '
        "so CUDA would expose only 0"
    )
    assert error.hint == (
        "To hide every GPU, set CUDA_VISIBLE_DEVICES=-1 alone; otherwise drop the -1: CUDA_VISIBLE_DEVICES=0,1"
    )


@pytest.mark.parametrize(("value", "exposed"), [("-1,0", "no GPU"), ("0,-1", "only 0"), ("-1,-1", "no GPU")])
def test_minus_one_anywhere_but_alone_is_an_error(value, exposed):
    error = usage_error(visible_gpus, value, INVENTORY)
    assert error.message.endswith(f"so CUDA would expose {exposed}")


def test_out_of_range_index():
    error = usage_error(visible_gpus, "0,7", INVENTORY)
    assert error.message == 'CUDA_VISIBLE_DEVICES="0,7": entry 7 is out of range (this machine has GPUs 0-3)'
    assert error.hint.startswith("CUDA would stop reading there and expose only 0.")


def test_out_of_range_on_a_one_gpu_machine():
    error = usage_error(visible_gpus, "1", INVENTORY[:1])
    assert error.message == 'CUDA_VISIBLE_DEVICES="1": entry 1 is out of range (this machine has GPU 0)'


def test_out_of_range_with_gaps_in_the_inventory():
    error = usage_error(visible_gpus, "1", [INVENTORY[0], INVENTORY[2]])
    assert "(this machine has GPUs 0,2)" in error.message


@pytest.mark.parametrize("value", ["0,0", "1, 1", "0,1,0"])
def test_index_twice_is_a_repeat(value):
    error = usage_error(visible_gpus, value, INVENTORY)
    repeated = value.split(",")[0].strip()
    assert error.message == f'CUDA_VISIBLE_DEVICES="{value}": entry {repeated} is repeated; each GPU may appear once'


def test_index_and_uuid_of_the_same_gpu_are_a_repeat():
    error = usage_error(visible_gpus, "0,GPU-8f2a", INVENTORY)
    assert error.message == (
        'CUDA_VISIBLE_DEVICES="0,GPU-8f2a": entry 0 and GPU-8f2a both name GPU 0; each GPU may appear once'
    )
    assert error.hint == "Remove the repeat, e.g. CUDA_VISIBLE_DEVICES=0"


def test_leading_zeros_name_the_same_index():
    error = usage_error(visible_gpus, "1,01", INVENTORY)
    assert "entry 1 and 01 both name GPU 1" in error.message


def test_no_inventory_means_nothing_visible_but_syntax_is_still_checked():
    assert visible_gpus("0,1", []) == []
    assert visible_gpus(None, []) == []
    usage_error(visible_gpus, "abc", [])


def test_visible_devices_value_round_trips():
    visible = visible_gpus(" GPU-1b , 3 ", INVENTORY)
    assert visible_devices_value(visible) == "GPU-1b,3"
    assert visible_gpus(visible_devices_value(visible), INVENTORY) == visible


def test_device_order_env_makes_cuda_number_gpus_like_nvidia_smi():
    assert DEVICE_ORDER_ENV == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


# --- select_gpus: --gpus --------------------------------------------------------------

ALL = visible_gpus(None, INVENTORY)
TWO_OF_FOUR = visible_gpus("1,3", INVENTORY)


@pytest.mark.parametrize("request_", [None, "all", "ALL", " all "])
def test_all_is_every_visible_gpu(request_):
    assert select_gpus(request_, ALL, cuda_visible_devices=None) == ALL


@pytest.mark.parametrize(("request_", "expected"), [("1", [0]), ("2", [0, 1]), (" 3 ", [0, 1, 2]), ("4", [0, 1, 2, 3])])
def test_a_single_integer_is_a_count(request_, expected):
    assert indices(select_gpus(request_, ALL, cuda_visible_devices=None)) == expected


def test_count_takes_the_first_visible_gpus_in_cuda_order():
    visible = visible_gpus("3,1,0", INVENTORY)
    assert indices(select_gpus("2", visible, cuda_visible_devices="3,1,0")) == [3, 1]


@pytest.mark.parametrize(
    ("request_", "expected"), [("0,2", [0, 2]), ("2,0", [2, 0]), (" 0 , 3 ", [0, 3]), ("1,", [1]), ("3, ", [3])]
)
def test_a_comma_list_is_ordinals(request_, expected):
    assert indices(select_gpus(request_, ALL, cuda_visible_devices=None)) == expected


def test_ordinals_count_among_the_visible_gpus():
    assert indices(select_gpus("1,", TWO_OF_FOUR, cuda_visible_devices="1,3")) == [3]
    assert indices(select_gpus("1,0", TWO_OF_FOUR, cuda_visible_devices="1,3")) == [3, 1]


def test_zero_gpus_is_an_error():
    error = usage_error(select_gpus, "0", ALL, cuda_visible_devices=None)
    assert error.message == "--gpus 0 asks for no GPU: use --gpus 1 or more, or --cpu to run without GPUs"


@pytest.mark.parametrize("request_", ["-1", "abc", "", " ", "1.5", ",", "0,,1", ",1", "0,-1", "two", "2 gpus"])
def test_malformed_requests_are_errors(request_):
    error = usage_error(select_gpus, request_, ALL, cuda_visible_devices=None)
    assert error.message == (
        f'--gpus "{request_.strip()}" is not a GPU count or list: '
        "use --gpus 2 (a count), --gpus 0,2 (positions among the visible GPUs) or --gpus all"
    )


@pytest.mark.parametrize("request_", ["0,0", "1,0,1"])
def test_repeated_ordinal_is_an_error(request_):
    error = usage_error(select_gpus, request_, ALL, cuda_visible_devices=None)
    repeated = request_.split(",")[-1]
    assert error.message == f"--gpus {request_} names ordinal {repeated} twice: each GPU may appear once"


def test_ordinal_out_of_range_without_the_variable():
    error = usage_error(select_gpus, "0,4", ALL, cuda_visible_devices=None)
    assert error.message == "--gpus 0,4: ordinal 4 is out of range; this machine has 4 GPUs (ordinals 0-3)"
    assert error.hint is None


def test_ordinal_out_of_range_with_the_variable_shows_what_ordinals_mean():
    error = usage_error(select_gpus, "1,3", TWO_OF_FOUR, cuda_visible_devices="1,3")
    assert error.message == (
        "--gpus 1,3: ordinal 3 is out of range; CUDA_VISIBLE_DEVICES=1,3 exposes 2 GPUs (ordinals 0-1)"
    )
    assert error.hint == (
        "--gpus counts positions among the visible GPUs, not physical indices: "
        "0 = GPU 1 (NVIDIA H100 80GB HBM3, 81559 MiB), 1 = GPU 3 (NVIDIA H100 80GB HBM3, 81559 MiB)"
    )


def test_ordinal_out_of_range_with_one_visible_gpu():
    visible = visible_gpus("2", INVENTORY)
    error = usage_error(select_gpus, "1,", visible, cuda_visible_devices="2")
    assert error.message == "--gpus 1,: ordinal 1 is out of range; CUDA_VISIBLE_DEVICES=2 exposes 1 GPU (ordinal 0)"


def test_more_gpus_than_the_variable_exposes():
    visible = visible_gpus("0,1", INVENTORY)
    error = usage_error(select_gpus, "3", visible, cuda_visible_devices="0,1")
    assert error.message == (
        "3 GPUs requested, but CUDA_VISIBLE_DEVICES=0,1 exposes 2: use --gpus 2, or widen CUDA_VISIBLE_DEVICES"
    )


def test_more_gpus_than_the_variable_exposes_quotes_a_value_with_spaces():
    error = usage_error(select_gpus, "3", visible_gpus("0, 1", INVENTORY), cuda_visible_devices="0, 1")
    assert 'but CUDA_VISIBLE_DEVICES="0, 1" exposes 2' in error.message


def test_more_gpus_than_the_machine_has():
    error = usage_error(select_gpus, "3", ALL[:2], cuda_visible_devices=None)
    assert error.message == "3 GPUs requested, but this machine has 2: use --gpus 2"


@pytest.mark.parametrize("request_", [None, "all", "1", "0,1"])
def test_no_gpu_on_the_machine_suggests_cpu(request_):
    error = usage_error(select_gpus, request_, [], cuda_visible_devices=None)
    assert error.message == "No GPU is visible: no NVIDIA GPU was found on this machine"
    assert "--cpu" in error.hint


@pytest.mark.parametrize("value", ["", "-1"])
def test_variable_hiding_every_gpu_suggests_cpu_or_unsetting_it(value):
    error = usage_error(select_gpus, "2", visible_gpus(value, INVENTORY), cuda_visible_devices=value)
    assert error.message == f'No GPU is visible: CUDA_VISIBLE_DEVICES="{value}" hides every GPU'
    assert error.hint == "Use --cpu to run on CPU, or unset CUDA_VISIBLE_DEVICES."


def test_variable_naming_gpus_on_a_machine_without_a_driver():
    error = usage_error(select_gpus, None, visible_gpus("0,1", []), cuda_visible_devices="0,1")
    assert error.message == (
        "No GPU is visible: no NVIDIA GPU was found on this machine "
        '(CUDA_VISIBLE_DEVICES="0,1" names GPUs, but no driver reports any)'
    )
    assert "--cpu" in error.hint


def test_syntax_errors_come_before_the_no_gpu_error():
    error = usage_error(select_gpus, "abc", [], cuda_visible_devices=None)
    assert "is not a GPU count or list" in error.message


# --- describe_gpu ---------------------------------------------------------------------


def test_describe_gpu():
    visible = visible_gpus("3", INVENTORY)[0]
    assert describe_gpu(visible) == "GPU 3 (NVIDIA H100 80GB HBM3, 81559 MiB)"
    assert describe_gpu(visible, ordinal=0) == "cuda:0 = GPU 3 (NVIDIA H100 80GB HBM3, 81559 MiB)"


def test_describe_gpu_without_memory_and_for_mig():
    unknown_memory = VisibleGpu(entry="0", gpu=Gpu(index=0, uuid=UUID0, name="NVIDIA GB10", memory_mib=0))
    assert describe_gpu(unknown_memory) == "GPU 0 (NVIDIA GB10)"
    assert describe_gpu(VisibleGpu(entry=MIG_NEW, gpu=None), ordinal=1) == f"cuda:1 = MIG {MIG_NEW}"
    old_style = visible_gpus(f"MIG-{UUID2}/1/0", INVENTORY)[0]
    assert describe_gpu(old_style) == f"MIG MIG-{UUID2}/1/0 on GPU 2 (NVIDIA H100 80GB HBM3)"


# --- parse_inventory_csv --------------------------------------------------------------

CSV = "".join(f"{i}, {u}, {n}, {m}\n" for i, u, n, m in FOUR_GPUS)


def test_parse_inventory_csv():
    assert parse_inventory_csv(CSV) == INVENTORY


def test_parse_inventory_csv_tolerates_spacing_blank_lines_and_units():
    text = f"\n  0 ,{UUID0},  NVIDIA A100-SXM4-80GB ,81920 MiB  \r\n\n1,{UUID1},Tesla T4,15360\n"
    assert parse_inventory_csv(text) == [
        Gpu(index=0, uuid=UUID0, name="NVIDIA A100-SXM4-80GB", memory_mib=81920),
        Gpu(index=1, uuid=UUID1, name="Tesla T4", memory_mib=15360),
    ]


@pytest.mark.parametrize("memory", ["[N/A]", "N/A", "[Not Supported]"])
def test_parse_inventory_csv_unknown_memory_is_zero(memory):
    assert parse_inventory_csv(f"0, {UUID0}, NVIDIA GB10, {memory}")[0].memory_mib == 0


def test_parse_inventory_csv_keeps_a_comma_in_the_name():
    assert parse_inventory_csv(f"0, {UUID0}, Weird, Name, 1024")[0].name == "Weird, Name"


def test_parse_inventory_csv_empty_is_no_gpu():
    assert parse_inventory_csv("") == []
    assert parse_inventory_csv("\n \n") == []


@pytest.mark.parametrize(
    "text",
    [
        "No devices were found",
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
        "index, uuid, name, memory.total [MiB]",  # a header: queried without noheader
        f"0, {UUID0}, H100",  # too few fields
        f"x, {UUID0}, H100, 1024",
        f"0, 8f2a, H100, 1024",  # uuid without GPU-
        f"0, {UUID0}, , 1024",  # no name
        f"0, {UUID0}, H100, lots",
        f"-1, {UUID0}, H100, 1024",
    ],
)
def test_parse_inventory_csv_rejects_garbage(text):
    with pytest.raises(DdprunError) as caught:
        parse_inventory_csv(f"{CSV}{text}\n")
    assert not isinstance(caught.value, UsageError)
    assert "line 5 of nvidia-smi's GPU list" in caught.value.message


# --- read_inventory / read_driver_version through a stub nvidia-smi -------------------


@pytest.fixture
def no_nvml(monkeypatch):
    """Make NVML absent even on a machine with a driver, so the nvidia-smi path is what runs."""
    FakeNvml([], fail={"init": pynvml.NVML_ERROR_LIBRARY_NOT_FOUND}).install(monkeypatch)


@pytest.fixture
def bin_dir(tmp_path, monkeypatch) -> Path:
    """An empty directory that is the whole PATH: nothing but what a test installs there."""
    directory = tmp_path / "bin"
    directory.mkdir()
    monkeypatch.setenv("PATH", str(directory))
    return directory


def test_read_inventory_from_stub_nvidia_smi(no_nvml, tmp_path, monkeypatch):
    stub = install_stub_nvidia_smi(tmp_path / "stub", FOUR_GPUS)
    monkeypatch.setenv("PATH", path_with(stub.parent))
    assert read_inventory() == INVENTORY
    assert read_driver_version() == "550.54.15"


def test_stub_answers_the_plain_and_driver_queries(tmp_path):
    stub = install_stub_nvidia_smi(tmp_path, FOUR_GPUS, driver_version="535.104.05", cuda_version="12.2")
    plain = subprocess.run([str(stub)], capture_output=True, text=True, check=True).stdout
    assert "Driver Version: 535.104.05" in plain and "CUDA Version: 12.2" in plain
    query = [str(stub), "--query-gpu=driver_version", "--format=csv,noheader"]
    assert subprocess.run(query, capture_output=True, text=True, check=True).stdout == "535.104.05\n" * 4
    listing = subprocess.run([str(stub), "-L"], capture_output=True, text=True, check=True).stdout
    assert listing.splitlines()[3] == f"GPU 3: NVIDIA H100 80GB HBM3 (UUID: {UUID3})"


def test_nvidia_smi_absent_means_no_gpu(no_nvml, bin_dir):
    assert read_inventory() == []
    assert read_driver_version() is None


@pytest.mark.parametrize(
    ("stdout", "exit_code"),
    [
        ("No devices were found\n", 6),
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", 9),
        ("total garbage\n", 0),
        (CSV, 1),  # good output but a failing exit status is not trusted
    ],
)
def test_broken_nvidia_smi_means_no_gpu(no_nvml, bin_dir, stdout, exit_code):
    install_stub_nvidia_smi(bin_dir, [], stdout=stdout, exit_code=exit_code)
    assert read_inventory() == []
    assert read_driver_version() is None


def test_hanging_nvidia_smi_means_no_gpu(no_nvml, bin_dir, monkeypatch):
    hanging = bin_dir / "nvidia-smi"
    hanging.write_text("#!/bin/sh\nexec sleep 30\n")
    hanging.chmod(0o755)
    monkeypatch.setattr(devices, "_SMI_TIMEOUT_S", 0.2)
    assert read_inventory() == []


def test_machine_with_driver_but_no_gpu(no_nvml, bin_dir):
    install_stub_nvidia_smi(bin_dir, [])
    assert read_inventory() == []


# --- NVML path, through pynvml's functions replaced by a stand-in ----------------------


class FakeNvml:
    """Plays the pynvml functions devices.py calls; `fail` maps a function name to an NVML error code."""

    def __init__(self, gpus, *, fail=None, driver="560.35.03"):
        self.gpus, self.fail, self.driver, self.calls = gpus, dict(fail or {}), driver, []

    def _call(self, name, result=None):
        self.calls.append(name)
        if name in self.fail:
            raise pynvml.NVMLError(self.fail[name])  # NVML's own mapping to NVMLError_<Name>
        return result

    def install(self, monkeypatch):
        monkeypatch.setattr(devices, "_driver_present", lambda: True)  # as on a machine with the driver
        answers = {
            "nvmlInit": lambda: self._call("init"),
            "nvmlShutdown": lambda: self._call("shutdown"),
            "nvmlDeviceGetCount": lambda: self._call("count", len(self.gpus)),
            "nvmlDeviceGetHandleByIndex": lambda index: self._call("handle", 1000 + index),
            "nvmlDeviceGetUUID": lambda handle: self._call("uuid", self.gpus[handle - 1000][1]),
            "nvmlDeviceGetName": lambda handle: self._call("name", self.gpus[handle - 1000][2]),
            "nvmlDeviceGetMemoryInfo": lambda handle: self._call(
                "memory", SimpleNamespace(total=self.gpus[handle - 1000][3] * 1024 * 1024 + 12345, free=0, used=0)
            ),
            "nvmlSystemGetDriverVersion": lambda: self._call("driver", self.driver),
        }
        for name, function in answers.items():
            monkeypatch.setattr(pynvml, name, function)
        return self


@pytest.fixture
def stub_smi_two_gpus(tmp_path, monkeypatch):
    """nvidia-smi answers with two GPUs, so a result of four proves NVML was read."""
    stub = install_stub_nvidia_smi(tmp_path / "stub", FOUR_GPUS[:2], driver_version="550.54.15")
    monkeypatch.setenv("PATH", path_with(stub.parent))


def test_nvml_is_read_first(stub_smi_two_gpus, monkeypatch):
    fake = FakeNvml(FOUR_GPUS).install(monkeypatch)
    assert read_inventory() == INVENTORY
    assert fake.calls[0] == "init" and fake.calls[-1] == "shutdown"
    assert read_driver_version() == "560.35.03"


def test_nvml_bytes_from_old_bindings_are_decoded(monkeypatch):
    old = [(i, u.encode(), n.encode(), m) for i, u, n, m in FOUR_GPUS[:1]]
    FakeNvml(old, driver=b"470.82.01").install(monkeypatch)
    assert read_inventory() == INVENTORY[:1]
    assert read_driver_version() == "470.82.01"


@pytest.mark.parametrize(
    "code", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED, pynvml.NVML_ERROR_NO_PERMISSION]
)
def test_nvml_init_failure_falls_back_to_nvidia_smi(stub_smi_two_gpus, monkeypatch, code):
    fake = FakeNvml(FOUR_GPUS, fail={"init": code}).install(monkeypatch)
    assert read_inventory() == INVENTORY[:2]
    assert "shutdown" not in fake.calls  # nothing to shut down after a failed init
    assert read_driver_version() == "550.54.15"


def test_nvml_device_error_falls_back_to_nvidia_smi(stub_smi_two_gpus, monkeypatch):
    fake = FakeNvml(FOUR_GPUS, fail={"uuid": pynvml.NVML_ERROR_GPU_IS_LOST}).install(monkeypatch)
    assert read_inventory() == INVENTORY[:2]
    assert fake.calls[-1] == "shutdown"


def test_nvml_driver_version_error_falls_back_to_nvidia_smi(stub_smi_two_gpus, monkeypatch):
    FakeNvml(FOUR_GPUS, fail={"driver": pynvml.NVML_ERROR_UNKNOWN}).install(monkeypatch)
    assert read_driver_version() == "550.54.15"


def test_nvml_missing_a_function_falls_back_to_nvidia_smi(stub_smi_two_gpus, monkeypatch):
    FakeNvml(FOUR_GPUS, fail={"count": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}).install(monkeypatch)
    assert read_inventory() == INVENTORY[:2]


def test_nvml_failing_shutdown_keeps_the_answer(stub_smi_two_gpus, monkeypatch):
    FakeNvml(FOUR_GPUS, fail={"shutdown": pynvml.NVML_ERROR_UNINITIALIZED}).install(monkeypatch)
    assert read_inventory() == INVENTORY


def test_nvml_without_memory_support_reports_zero(monkeypatch):
    FakeNvml(FOUR_GPUS[:1], fail={"memory": pynvml.NVML_ERROR_NOT_SUPPORTED}).install(monkeypatch)
    assert read_inventory() == [Gpu(index=0, uuid=UUID0, name=INVENTORY[0].name, memory_mib=0)]


def test_without_the_pynvml_package_nvidia_smi_is_read(stub_smi_two_gpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert read_inventory() == INVENTORY[:2]
    assert read_driver_version() == "550.54.15"


def test_real_probe_never_raises():
    """Whatever this machine has (a driver or not), the probes answer."""
    assert isinstance(read_inventory(), list)
    assert read_driver_version() is None or read_driver_version()[0].isdigit()


def test_devices_imports_neither_torch_nor_pynvml():
    code = "import sys, ddprun.devices; print('torch' in sys.modules or 'pynvml' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert done.stdout.strip() == "False"


def test_without_a_driver_s_device_nodes_nvml_is_not_even_imported(stub_smi_two_gpus, monkeypatch):
    fake = FakeNvml(FOUR_GPUS).install(monkeypatch)
    monkeypatch.setattr(devices, "_driver_present", lambda: False)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # an import would raise ImportError
    assert len(read_inventory()) == 2  # nvidia-smi's answer
    assert fake.calls == []
