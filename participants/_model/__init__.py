"""The policy-model participant: admission, held responses, generation cuts, the fan-out share merge."""
