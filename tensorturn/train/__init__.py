"""The math and the loop, free of the pool: DiLoCo's outer step and averaging, the inner training
loop, the device and precision a machine trains in, seeds, and the math of distillation and soups."""
