"""Reference implementations (plain torch) that every backend is tested against."""
