"""What the experiment scripts share: the launch plan of a config (plan) and the records they write."""
