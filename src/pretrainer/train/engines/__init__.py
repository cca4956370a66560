"""What the loop needs from DeepSpeed that Accelerate does not give: skip-step inside the engine's step
(`deepspeed_gate`), per-layer gradients of partitioned parameters (`deepspeed_grads`), and Muon under ZeRO
(`deepspeed_muon`)."""
