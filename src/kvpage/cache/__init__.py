"""Cache management: tensor allocation and copies (controller) and tensor-free block bookkeeping."""
