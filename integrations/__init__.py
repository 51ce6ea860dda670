"""Host-framework adapters (DeepSpeed, fairseq), installed as moe_plugin.integrations."""
