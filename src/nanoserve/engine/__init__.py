"""The engine loop, the scheduler and cache managers, and the model runner with its input packer."""
