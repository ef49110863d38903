//! The work accounting on its own: its counters are process-wide, so this runs in its own test
//! binary, where no model test can add to them concurrently.

use recsys_engine::profile::{account, enable, take, Work};
use std::time::Duration;

#[test]
fn accounting_is_off_until_enabled_and_take_resets() {
    take();
    account(Work::Dense, || std::thread::sleep(Duration::from_millis(2)));
    assert_eq!(take(), [0.0; 3], "off by default");
    enable(true);
    account(Work::Attention, || {
        std::thread::sleep(Duration::from_millis(3))
    });
    let value = account(Work::Output, || 7);
    enable(false);
    assert_eq!(value, 7, "the region's value comes back");
    let spent = take();
    assert!(spent[Work::Attention as usize] >= 0.003, "{spent:?}");
    assert_eq!(spent[Work::Dense as usize], 0.0, "{spent:?}");
    assert!(spent[Work::Output as usize] < 0.001, "{spent:?}");
    assert_eq!(take(), [0.0; 3], "take resets");
}
