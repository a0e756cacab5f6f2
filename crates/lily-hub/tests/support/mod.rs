pub mod fake_hub;
