//! The collectives a device communicator (`NcclComm`) launched on its streams and has not
//! handed back yet, kept by the communicator (not by the [`super::Pending`] handle, which
//! carries only a ticket) so that their buffers outlive the calls whatever the caller does:
//! a handle dropped on an error path must not free memory a running NCCL kernel writes.
//!
//! Plain bookkeeping, generic over what a call holds, so the rules are tested on the CPU:
//! each call gets a number; a call is handed back only once, and only after the older calls
//! of its group (every member must finish a group's collectives in the order it started
//! them, as [`super::Communicator::start`] says); the newest call of a group stands for all
//! of the group's (they share one stream, so it finishes last).

use std::collections::VecDeque;

use super::Group;

/// The calls in flight, oldest first; see the [module docs](self).
#[derive(Debug)]
pub(crate) struct LaunchedCalls<T> {
    next_id: u64,
    calls: VecDeque<(u64, Group, T)>,
}

impl<T> Default for LaunchedCalls<T> {
    fn default() -> Self {
        LaunchedCalls {
            next_id: 0,
            calls: VecDeque::new(),
        }
    }
}

impl<T> LaunchedCalls<T> {
    /// Keeps `call`, launched on `group`'s communicator, and returns its number.
    pub(crate) fn push(&mut self, group: Group, call: T) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.calls.push_back((id, group, call));
        id
    }

    /// Hands back call `id` of `group`. Fails, saying why, when it is not here (handed back
    /// already, or launched by another communicator) or when an older call of `group` is
    /// still here.
    pub(crate) fn take(&mut self, id: u64, group: Group) -> Result<T, String> {
        let Some(at) = self.calls.iter().position(|(i, _, _)| *i == id) else {
            return Err(format!(
                "collective number {id} is not in flight here: it was finished already or \
                 started on another communicator"
            ));
        };
        if self.calls[at].1 != group {
            return Err(format!(
                "collective number {id} ran on the {}, not the {group}",
                self.calls[at].1
            ));
        }
        if let Some((older, _, _)) = self.calls.iter().find(|(_, g, _)| *g == group) {
            if *older != id {
                return Err(format!(
                    "collective number {older} on the {group} started before number {id} and \
                     is not finished: finish the collectives of a group in the order they \
                     started"
                ));
            }
        }
        match self.calls.remove(at) {
            Some((_, _, call)) => Ok(call),
            None => Err(format!("collective number {id} vanished while being taken")),
        }
    }

    /// The newest call of `group` in flight: once it finished, all of the group's have.
    pub(crate) fn newest(&self, group: Group) -> Option<&T> {
        self.calls
            .iter()
            .rev()
            .find(|(_, g, _)| *g == group)
            .map(|(_, _, call)| call)
    }

    /// Whether no call is in flight.
    pub(crate) fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Hands back every call in flight, oldest first (when the communicator goes away).
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = (Group, T)> + '_ {
        self.calls.drain(..).map(|(_, group, call)| (group, call))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DP: Group = Group::DataParallel;
    const PP: Group = Group::Pipeline;

    #[test]
    fn calls_come_back_once_in_the_order_of_their_group() {
        let mut calls = LaunchedCalls::default();
        let a = calls.push(DP, "a");
        let b = calls.push(PP, "b");
        let c = calls.push(DP, "c");
        assert_ne!(a, c);
        // `c` is younger than `a` on the same group.
        let err = calls.take(c, DP).unwrap_err();
        assert!(err.contains("order they started"), "{err}");
        // Another group's call may finish in between.
        assert_eq!(calls.take(b, PP), Ok("b"));
        assert_eq!(calls.take(a, DP), Ok("a"));
        let again = calls.take(a, DP).unwrap_err();
        assert!(again.contains("not in flight here"), "{again}");
        assert_eq!(calls.take(c, DP), Ok("c"));
        assert!(calls.is_empty());
    }

    #[test]
    fn a_ticket_names_its_group() {
        let mut calls = LaunchedCalls::default();
        let a = calls.push(DP, 1);
        let err = calls.take(a, PP).unwrap_err();
        assert!(err.contains("data-parallel"), "{err}");
        assert_eq!(calls.take(a, DP), Ok(1));
    }

    #[test]
    fn the_newest_call_of_a_group_stands_for_it() {
        let mut calls = LaunchedCalls::default();
        assert_eq!(calls.newest(DP), None);
        calls.push(DP, 1);
        calls.push(PP, 2);
        calls.push(DP, 3);
        assert_eq!(calls.newest(DP), Some(&3));
        assert_eq!(calls.newest(PP), Some(&2));
        let left: Vec<_> = calls.drain().collect();
        assert_eq!(left, vec![(DP, 1), (PP, 2), (DP, 3)]);
        assert!(calls.is_empty());
    }
}
