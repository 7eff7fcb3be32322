"""LoRA over a (4-bit) base: layers, injection, NF4 quantisation, PEFT-format adapter I/O.

Import-time cost: torch only; bitsandbytes (slow to import) and safetensors are imported
where they are used.
"""
from lora.adapter_io import (
    export_merged,
    load_adapter,
    load_lora_state_dict,
    lora_state_dict,
    merged_state_dict,
    save_adapter,
)
from lora.inject import (
    DEFAULT_EXCLUDE,
    DEFAULT_TARGETS,
    LoRAConfig,
    ParamCount,
    count_parameters,
    disable_adapters,
    enable_gradient_checkpointing,
    find_target_names,
    freeze_all_but_lora,
    freeze_reference_adapter,
    inject_lora,
    lora_modules,
    lora_parameters,
)
from lora.layer import LoRALinear, frozen_adapter_casts, fused_forward, is_linear4bit
from lora.quant import (
    MemoryReport,
    QuantReport,
    dequantize_weight,
    memory_report,
    quantize_linear_4bit,
    quantize_model_4bit,
)

__all__ = [
    "DEFAULT_EXCLUDE", "DEFAULT_TARGETS", "LoRAConfig", "LoRALinear", "MemoryReport", "frozen_adapter_casts",
    "fused_forward",
    "ParamCount", "QuantReport", "count_parameters", "dequantize_weight", "disable_adapters", "freeze_reference_adapter",
    "enable_gradient_checkpointing", "export_merged", "find_target_names",
    "freeze_all_but_lora", "inject_lora", "is_linear4bit", "load_adapter",
    "load_lora_state_dict", "lora_modules", "lora_parameters", "lora_state_dict",
    "memory_report", "merged_state_dict", "quantize_linear_4bit", "quantize_model_4bit",
    "save_adapter",
]
