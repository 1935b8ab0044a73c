"""The machine a run lands on: `loracls doctor`, ROCm rules, what the CPU computes fast, devices, precision
and memory."""
